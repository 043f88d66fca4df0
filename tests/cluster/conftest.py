from tests.fixtures.services import moto_server, redis_server  # noqa: F401  (real Redis, real S3)
