"""A schemathesis run over the data plane's OpenAPI schema (in-process ASGI: the real app, registry, replica
logic and engine) finds no 5xx, with a valid API key and with a wrong one. Bounded examples keep it to a
minute or two; derandomized, so a failure reproduces.

Driven through `operation.as_strategy()` + hypothesis directly, as tests/registry/test_openapi_fuzz does."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from tests.deployments import data_plane_kit as K


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    kit = K.build(tmp_path_factory.mktemp("fuzz"), max_tokens_limit=64)  # bounded work per fuzzed request
    yield kit
    K.close(kit)


def test_no_server_errors(kit):
    schema = schemathesis.openapi.from_asgi("/openapi.json", kit.app)
    operations = [r.ok() for r in schema.get_all_operations()]
    labels = {op.label for op in operations}
    assert {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /v1/models/{model_id}"} <= labels
    statuses = []
    for op in operations:
        @given(case=op.as_strategy())
        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                  database=None)
        def run(case):
            for key in (K.ACME, "sk-wrong-key-0000"):
                response = case.call_and_validate(headers={"Authorization": f"Bearer {key}"},
                                                  checks=[not_a_server_error])
                statuses.append((op.label, response.status_code))
            if isinstance(case.body, dict) and "model" in case.body:  # the same body on a model that exists
                case.body["model"] = kit.base
                response = case.call_and_validate(headers={"Authorization": f"Bearer {K.ACME}"},
                                                  checks=[not_a_server_error])
                statuses.append((op.label, response.status_code))

        run()
    served = {label for label, status in statuses if status == 200}
    print(f"{len(statuses)} calls; 200s on {sorted(served)}")
    assert all(status < 500 for _, status in statuses)
    assert "POST /v1/completions" in served or "POST /v1/chat/completions" in served  # reached the engine
