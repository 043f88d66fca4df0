"""The replica's one table from what can fail on it to the OpenAI error a client gets: each exception type (the
engine's typed refusals, the registry's, the replica's own) maps to a status and a code, and a bare `ValueError` (a
sampling parameter the engine's `SamplingParams` refused) is the request's fault, a 400, wherever it comes from. An
engine core that died is a 503 the client may retry at once elsewhere (Serve replaces this replica).
Failures of the service are typed where they happen (`AdapterLoadFailed`), so no bare exception stands for one."""

from __future__ import annotations

import functools
from typing import Optional

from deployments.data_plane.protocol import GenerateRequest, error_chunk
from deployments.replica.adapters import AdapterBlocked, AdapterLoadFailed
from deployments.replica.prompts import Refused, prompt_param

__all__ = ["error_chunk_of", "error_table"]

PROMPT = "<the prompt's parameter>"  # param: `messages` on chat, `prompt` on completions (as OpenAI names it)


@functools.cache
def error_table() -> tuple[tuple[type, int, Optional[str], Optional[str], Optional[float]], ...]:
    """(exception type, status, code, param, retry after seconds) rows, subclasses before their bases;
    code/param/retry None: the exception's own (`code`, `param`, `retry_after_s` attributes)."""
    from jinja2 import TemplateError

    from engine_ext import EngineDeadError, PromptTooLongError, RequestRefused
    from registry import RegistryUnavailable

    return (
        (AdapterBlocked, 403, "model_disabled", None, None),
        (RegistryUnavailable, 503, "service_unavailable", None, None),
        (AdapterLoadFailed, 503, "adapter_load_failed", None, None),
        (EngineDeadError, 503, "engine_unavailable", None, 1.0),
        (Refused, 400, None, None, None),
        (PromptTooLongError, 400, "context_length_exceeded", PROMPT, None),
        (RequestRefused, 400, "invalid_request", None, None),
        (TemplateError, 400, "invalid_request", "messages", None),  # a chat template that fails on these messages
        (ValueError, 400, "invalid_request", None, None),
    )


def error_chunk_of(exc: BaseException, req: GenerateRequest) -> dict:
    """The error chunk `exc` stands for; an exception the table does not name is re-raised (a fault)."""
    for kind, status, code, param, retry in error_table():
        if isinstance(exc, kind):
            param = prompt_param(req) if param == PROMPT else param or getattr(exc, "param", None)
            retry = retry or getattr(exc, "retry_after_s", None)
            return error_chunk(status, code or getattr(exc, "code", "invalid_request"), str(exc), param,
                               retry_after_s=retry if status == 503 else None)
    raise exc
