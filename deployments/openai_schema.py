"""OpenAI request bodies we accept, and the `model` field's grammar.

Unknown fields are ignored (clients send many optional ones); fields we cannot honour
(n > 1, logprobs, tools) are refused with a clear 400 rather than silently dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["CompletionRequest", "ChatCompletionRequest", "ChatMessage", "ModelRef", "parse_model", "NAME_PATTERN"]

# Same alphabet as the registry's names: no '/', no '\\', no ':' beyond the separator, no
# scheme -- so `model` can never smuggle in a path or URL.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class ModelRef:
    base: Optional[str]  # None: not given ("adapter" alone)
    adapter: Optional[str]  # None: the base model itself


def parse_model(model: str, base_name: str) -> ModelRef:
    """`base`, `base:adapter` or `adapter` -> ModelRef; ValueError when malformed."""
    parts = model.split(":")
    if len(parts) > 2 or not all(NAME_PATTERN.match(p) for p in parts):
        raise ValueError(f"model must be 'base', 'base:adapter' or 'adapter' (names of [A-Za-z0-9_.-]), got {model!r}")
    if len(parts) == 2:
        return ModelRef(parts[0], parts[1])
    if parts[0] == base_name:
        return ModelRef(base_name, None)
    return ModelRef(None, parts[0])


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1, max_length=200)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=1, description="only n=1 is supported")
    stop: Optional[Union[str, list[str]]] = Field(None, validate_default=True)
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logprobs: Optional[Any] = None
    user: Optional[str] = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Optional[Union[str, list[str]]]) -> list[str]:
        stops = [] if v is None else [v] if isinstance(v, str) else list(v)
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop: up to 4 non-empty strings")
        return stops

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: Any) -> None:
        if v not in (None, False, 0):
            raise ValueError("logprobs are not supported")
        return None

    def wanted_tokens(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int]]
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Union[str, list[str], list[int]]) -> Union[str, list[int]]:
        if isinstance(v, list):
            if v and all(isinstance(x, str) for x in v):
                if len(v) != 1:
                    raise ValueError("only one prompt per request is supported")
                return v[0]
            if not v:
                raise ValueError("prompt must not be empty")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer"]
    content: Union[str, list[dict[str, Any]]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: Optional[list[Any]] = None

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v: Optional[list[Any]]) -> None:
        if v:
            raise ValueError("tools are not supported")
        return None
