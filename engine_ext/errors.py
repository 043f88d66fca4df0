"""Typed refusals of a request, so a serving layer maps them to its answers by type, never by message text (all are
ValueErrors, what `add_request` raised before they had types of their own); and the engine's own failure."""

from __future__ import annotations

__all__ = ["RequestRefused", "PromptTooLongError", "InvalidParameterError", "EngineDeadError"]


class RequestRefused(ValueError):
    """`add_request` refused the request before any work; `param` names the field at fault, if one is."""

    param: str | None = None


class PromptTooLongError(RequestRefused):
    """The prompt does not fit: `prompt_tokens` against `limit` tokens, the context length (`max_model_len`) or
    what the whole KV cache holds (with its drafting room), whichever is less."""

    param = "prompt"

    def __init__(self, message: str, prompt_tokens: int, limit: int):
        super().__init__(message)
        self.prompt_tokens, self.limit = prompt_tokens, limit


class InvalidParameterError(RequestRefused):
    """A sampling parameter the model cannot take (a `logit_bias` token outside its vocabulary)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class EngineDeadError(RuntimeError):
    """The engine core is gone (its process exited): every request in flight ended with this, and the engine takes
    no more. Nothing of the request was at fault: another engine may serve it."""
