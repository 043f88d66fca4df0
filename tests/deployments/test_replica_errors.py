"""The replica's one table from failures to OpenAI errors (deployments/replica/errors.py): typed refusals of the
engine, the registry and the replica each map to one status and code, a bare ValueError is always the request's
fault (400), and anything the table does not name is a fault that propagates."""

import pytest

from deployments.data_plane.protocol import GenerateRequest
from deployments.replica.adapters import AdapterBlocked, AdapterLoadFailed
from deployments.replica.errors import error_chunk_of
from deployments.replica.prompts import Refused
from engine_ext import PromptTooLongError, RequestRefused
from registry import RegistryUnavailable

CHAT = GenerateRequest("r1", None, {"max_tokens": 1}, messages=[{"role": "user", "content": "hi"}])
TEXT = GenerateRequest("r2", None, {"max_tokens": 1}, prompt="hi")


def refused_param() -> RequestRefused:
    e = RequestRefused("top_k must be >= -1")
    e.param = "top_k"
    return e


@pytest.mark.parametrize("exc, req, status, code, param", [
    (AdapterBlocked("adapter 'x' is disabled"), TEXT, 403, "model_disabled", None),
    (RegistryUnavailable("blobs", OSError("down")), TEXT, 503, "service_unavailable", None),
    (AdapterLoadFailed("adapter x@1 could not be loaded: corrupt"), TEXT, 503, "adapter_load_failed", None),
    (Refused("context_length_exceeded", "too long", "messages"), CHAT, 400, "context_length_exceeded", "messages"),
    (PromptTooLongError("prompt has 9000 tokens", 9000, 8192), CHAT, 400, "context_length_exceeded", "messages"),
    (PromptTooLongError("prompt has 9000 tokens", 9000, 8192), TEXT, 400, "context_length_exceeded", "prompt"),
    (refused_param(), TEXT, 400, "invalid_request", "top_k"),
    (ValueError("temperature must be >= 0"), TEXT, 400, "invalid_request", None),
])
def test_each_failure_has_one_openai_error(exc, req, status, code, param):
    chunk = error_chunk_of(exc, req)
    assert (chunk["status"], chunk["code"], chunk.get("param")) == (status, code, param)
    assert chunk["type"] == "error" and chunk["message"] == str(exc)
    assert ("retry_after_s" in chunk) == isinstance(exc, RegistryUnavailable)


def test_a_failure_the_table_does_not_name_propagates():
    with pytest.raises(RuntimeError):
        error_chunk_of(RuntimeError("engine loop died"), TEXT)
