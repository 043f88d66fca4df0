import pytest


@pytest.fixture(scope="session")
def serve_app():
    from tests.deployments import serve_harness

    app = serve_harness.acquire()
    yield app
    serve_harness.release()


from tests.fixtures.services import moto_server, redis_server  # noqa: E402,F401  (real Redis, real S3)
