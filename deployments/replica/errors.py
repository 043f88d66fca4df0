"""The replica's one table from what can fail on it to the OpenAI error a client gets: each exception type (the
engine's typed refusals, the registry's, the replica's own) maps to a status and a code, and a bare `ValueError` (a
sampling parameter the engine's `SamplingParams` refused) is the request's fault, a 400, wherever it comes from.
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
def error_table() -> tuple[tuple[type, int, Optional[str], Optional[str]], ...]:
    """(exception type, status, code, param) rows, subclasses before their bases; code/param None: the
    exception's own (`code`, `param` attributes)."""
    from jinja2 import TemplateError

    from engine_ext import PromptTooLongError, RequestRefused
    from registry import RegistryUnavailable

    return (
        (AdapterBlocked, 403, "model_disabled", None),
        (RegistryUnavailable, 503, "service_unavailable", None),
        (AdapterLoadFailed, 503, "adapter_load_failed", None),
        (Refused, 400, None, None),
        (PromptTooLongError, 400, "context_length_exceeded", PROMPT),
        (RequestRefused, 400, "invalid_request", None),
        (TemplateError, 400, "invalid_request", "messages"),  # a chat template that fails on these messages
        (ValueError, 400, "invalid_request", None),
    )


def error_chunk_of(exc: BaseException, req: GenerateRequest) -> dict:
    """The error chunk `exc` stands for; an exception the table does not name is re-raised (a fault)."""
    for kind, status, code, param in error_table():
        if isinstance(exc, kind):
            param = prompt_param(req) if param == PROMPT else param or getattr(exc, "param", None)
            return error_chunk(status, code or getattr(exc, "code", "invalid_request"), str(exc), param,
                               retry_after_s=getattr(exc, "retry_after_s", None) if status == 503 else None)
    raise exc
