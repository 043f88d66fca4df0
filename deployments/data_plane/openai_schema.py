"""OpenAI request bodies we accept, and the `model` field's grammar.

Every field is honoured or refused: a field we do not implement (tools, response_format other than text,
echo, suffix, ...) or do not know is a 400 naming it, never silently dropped. Types are strict (a bool is
not an int, a number is not a string) and text must be valid Unicode (a lone surrogate is a 400).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (AfterValidator, AllowInfNan, BaseModel, ConfigDict, Field, Strict, ValidationInfo, WrapValidator, field_validator,
                      model_validator)

__all__ = ["CompletionRequest", "ChatCompletionRequest", "ChatMessage", "ModelRef", "parse_model", "NAME_PATTERN",
           "MAX_N", "MAX_CHOICES", "MAX_LOGPROBS"]

# Same alphabet as the registry's names: no '/', no '\\', no ':' beyond the separator, no
# scheme -- so `model` can never smuggle in a path or URL.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
MAX_N = 16  # choices per prompt
MAX_CHOICES = 64  # choices per request (prompts x n)
MAX_LOGPROBS = 20  # engine_ext.sampling_params.MAX_LOGPROBS (the edge does not import the engine)
MAX_STOP = 4


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


def _unicode(v: str) -> str:
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (it contains a lone surrogate)") from None
    return v


Text = Annotated[str, Strict(), AfterValidator(_unicode)]
Int = Annotated[int, Strict()]
# ints are accepted, bools are not; NaN and infinities (which Python's JSON reader takes) are not numbers here
Float = Annotated[float, Strict(), AllowInfNan(False)]
Bool = Annotated[bool, Strict()]
TokenId = Annotated[int, Strict(), Field(ge=0)]
# torch.Generator.manual_seed's range
Seed = Annotated[int, Strict(), Field(ge=-(2**63), le=2**64 - 1)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: Bool = False


class _Sampling(_Body):
    model: Text = Field(min_length=1, max_length=200)
    max_tokens: Optional[Int] = Field(None, ge=1)
    temperature: Float = Field(1.0, ge=0.0, le=2.0)
    top_p: Float = Field(1.0, gt=0.0, le=1.0)
    top_k: Int = Field(-1, ge=-1, description="-1 or 0: off")
    min_p: Float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: Float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: Float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: Float = Field(1.0, gt=0.0, le=10.0)
    logit_bias: Optional[dict[Text, Float]] = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    n: Int = Field(1, ge=1, le=MAX_N)
    stop: Optional[Union[Text, list[Text]]] = Field(None, validate_default=True)
    seed: Optional[Seed] = None
    stream: Bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[Text] = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Optional[Union[str, list[str]]]) -> list[str]:
        stops = [] if v is None else [v] if isinstance(v, str) else list(v)
        if len(stops) > MAX_STOP or any(not s for s in stops):
            raise ValueError(f"stop: up to {MAX_STOP} non-empty strings")
        return stops

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, v: Optional[StreamOptions], info: ValidationInfo) -> Optional[StreamOptions]:
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")  # as OpenAI answers
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: Optional[dict[str, float]]) -> dict[int, float]:
        out = {}
        for key, bias in (v or {}).items():
            if not key.isascii() or not key.isdigit() or len(key) > 9:
                raise ValueError(f"logit_bias keys are token ids, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError("logit_bias values must be in [-100, 100]")
            out[int(key)] = float(bias)
        if len(out) > 1024:
            raise ValueError("logit_bias: at most 1024 tokens")
        return out

    def wanted_tokens(self, default: int) -> tuple[int, bool]:
        """(max_tokens, whether the client asked for it)."""
        return (self.max_tokens, True) if self.max_tokens is not None else (default, False)

    def logprobs_k(self) -> Optional[int]:
        raise NotImplementedError

    def engine_sampling(self) -> dict[str, Any]:
        """engine_ext.SamplingParams fields, max_tokens aside."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k if self.top_k > 0 else -1,
                "min_p": self.min_p, "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty, "repetition_penalty": self.repetition_penalty,
                "logit_bias": dict(self.logit_bias or {}), "logprobs": self.logprobs_k(), "seed": self.seed,
                "stop": list(self.stop)}


Prompt = Union[Text, list[TokenId]]


def _is_ids(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(type(x) is int for x in v)  # type(): a bool is not an id


def _token_ids_fast(v: Any, handler: Any) -> Any:
    """Token-id prompts checked in one pass (pydantic's union tries each member per element: ~0.4 s of the
    event loop for a million ids); every other shape goes through the declared union."""
    if _is_ids(v):
        lists = [v]
    elif isinstance(v, list) and v and all(_is_ids(x) for x in v):
        lists = v
    else:
        return handler(v)
    if any(min(ids) < 0 for ids in lists):
        raise ValueError("token ids must be >= 0")
    return v


class CompletionRequest(_Sampling):
    prompt: Annotated[Union[Text, list[Text], list[TokenId], list[list[TokenId]]], WrapValidator(_token_ids_fast)]
    logprobs: Optional[Int] = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Bool = False
    best_of: Optional[Int] = Field(None, ge=1, le=MAX_N)
    suffix: Optional[Text] = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v: Any, info: ValidationInfo) -> list[Prompt]:
        """-> a list of prompts, each a string or a list of token ids."""
        if isinstance(v, str):
            prompts = [v]
        elif not v:
            raise ValueError("prompt must not be empty")
        elif isinstance(v[0], int):  # validated: a list is all ids, all strings or all id lists
            prompts = [v]
        elif any(isinstance(x, list) and not x for x in v):
            raise ValueError("prompt must not contain an empty token list")
        else:
            prompts = list(v)
        if len(prompts) * info.data.get("n", 1) > MAX_CHOICES:
            raise ValueError(f"at most {MAX_CHOICES} choices (prompts x n) per request")
        return prompts

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: Optional[str]) -> None:
        if v:
            raise ValueError("suffix is not supported")
        return None

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: Optional[int], info: ValidationInfo) -> None:
        if v is not None and v != info.data.get("n", 1):
            raise ValueError("only best_of == n is supported")
        return None

    def logprobs_k(self) -> Optional[int]:
        return self.logprobs


class TextPart(_Body):
    type: Literal["text"]
    text: Text


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[Text, list[TextPart]]] = None
    name: Optional[Text] = None
    tool_call_id: Optional[Text] = None

    @model_validator(mode="after")
    def _content(self) -> "ChatMessage":
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class ResponseFormat(_Body):
    type: Literal["text"] = Field(description="only plain text is supported")


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[Int] = Field(None, ge=1)
    logprobs: Optional[Bool] = None
    top_logprobs: Optional[Int] = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: Optional[ResponseFormat] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Literal["none"]] = None

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v: Optional[list[Any]]) -> None:
        if v:
            raise ValueError("tools are not supported")
        return None

    @field_validator("top_logprobs")
    @classmethod
    def _top(cls, v: Optional[int], info: ValidationInfo) -> Optional[int]:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    def wanted_tokens(self, default: int) -> tuple[int, bool]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, True
        return super().wanted_tokens(default)

    def logprobs_k(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None
