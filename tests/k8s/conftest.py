from tests.fixtures.services import moto_server  # noqa: F401  (real S3 for the deploy test)
