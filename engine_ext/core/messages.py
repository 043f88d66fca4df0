"""What an engine's client and its core send each other: typed messages of plain data (ids, token ids, numbers,
strings), each one msgpack array `[tag, *fields]` on the wire, never a pickle. A core in the client's own process
(ThreadCore) passes the same objects without encoding them.

Client -> core: requests, aborts and the engine's other calls, each applied by the core's loop (`apply`) in the
order sent. Core -> client: `StepOutputs`, one per step with every output of that step, and the answers to calls.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgpack

from ..errors import InvalidParameterError, PromptTooLongError, RequestRefused
from ..lora_adapter import AdapterError
from ..model_config import ModelLoadError

__all__ = ["encode", "decode", "wire_error", "error_of"]


# ------------------------------------------------------------------------------------------------ client -> core
class AddRequest(NamedTuple):
    request_id: str
    prompt_token_ids: list[int]
    params: dict  # SamplingParams fields; no stop strings (the client applies them)
    adapter: str | None
    share_prompt_with: str | None

    def apply(self, core) -> None:
        core.add_request(self)


class Abort(NamedTuple):
    request_id: str

    def apply(self, core) -> None:
        core.engine.abort_request(self.request_id)


class AddAdapter(NamedTuple):
    call: int
    name: str
    path: str
    pinned: bool

    def apply(self, core) -> None:
        core.add_adapter(self)  # parsed off the step loop; answered with a Reply


class RemoveAdapter(NamedTuple):
    call: int
    name: str

    def apply(self, core) -> None:
        core.remove_adapter(self)


class PinAdapter(NamedTuple):
    name: str
    pinned: bool

    def apply(self, core) -> None:
        core.engine.pin_adapter(self.name, self.pinned)


class DropCachedPrefixes(NamedTuple):
    name: str

    def apply(self, core) -> None:
        core.engine.drop_cached_prefixes(self.name)


class RankHostEviction(NamedTuple):
    """Updates of the host cache's eviction order (HostEvictionOrder.rank)."""

    ranks: dict[str, list | None]
    replace: bool

    def apply(self, core) -> None:
        core.eviction.rank(self.ranks, self.replace)


class GetStats(NamedTuple):
    call: int

    def apply(self, core) -> None:
        core.answer(self.call, core.stats)


class SetSpeculation(NamedTuple):
    """LLMEngine.set_speculation between steps: `spec` SpecConfig's fields, or None (plain decoding)."""

    call: int
    spec: dict | None

    def apply(self, core) -> None:
        core.answer(self.call, lambda: core.set_speculation(self.spec))


class Profile(NamedTuple):
    """Start recording the core's device activity ("start"), or stop and answer with its summary ("stop"):
    engine_ext.profiling.DeviceProfile, in the process that launches the kernels."""

    call: int
    action: str
    breakdown: bool

    def apply(self, core) -> None:
        core.answer(self.call, lambda: core.profile(self.action, self.breakdown))


class Shutdown(NamedTuple):
    def apply(self, core) -> None:
        core.stop()


# ------------------------------------------------------------------------------------------------ core -> client
class Ready(NamedTuple):
    """The core built its engine and takes requests."""

    max_model_len: int
    startup: dict  # the engine's start-up seconds (LLMEngine.startup)
    registered: list[str]
    host_adapters: list[str]
    pid: int | None  # the core's process (None: a thread of its client's)


class StartFailed(NamedTuple):
    error: list  # wire_error


class StepOutputs(NamedTuple):
    """Every output of one step (or of a drafting pass's first tokens), as parallel arrays: request `ids[i]` got
    `counts[i]` new tokens, the next ones of `tokens`. The rest is sparse, by index into `ids`."""

    ids: list[str]
    counts: list[int]
    tokens: list[int]  # [sum(counts)]
    ended: list[list]  # [index, finish reason] of the requests that finished
    logprobs: list[list]  # [index, [logprob] * n, [[top ids]] * n, [[top logprobs]] * n] with params.logprobs
    logits: list[list]  # [index, float32 bytes, [rows, vocab]] on the finished output, with params.return_logits


class Refused(NamedTuple):
    """The core refused a request when it was added (before any work)."""

    request_id: str
    error: list  # wire_error


class Failed(NamedTuple):
    """A step raised: these requests ended with it (the engine keeps serving)."""

    request_ids: list[str]
    message: str


class Reply(NamedTuple):
    call: int
    value: Any
    error: list | None  # wire_error


class AdapterState(NamedTuple):
    """The engine's adapters, sent whenever they change: registered names, and those parsed in host memory (least
    recently used first)."""

    registered: list[str]
    host_adapters: list[str]


_KINDS = (AddRequest, Abort, AddAdapter, RemoveAdapter, PinAdapter, DropCachedPrefixes, RankHostEviction, GetStats,
          SetSpeculation, Profile, Shutdown, Ready, StartFailed, StepOutputs, Refused, Failed, Reply, AdapterState)
_TAGS = {kind: tag for tag, kind in enumerate(_KINDS)}


def encode(message: NamedTuple) -> bytes:
    return msgpack.packb([_TAGS[type(message)], *message])


def decode(data: bytes) -> NamedTuple:
    tag, *fields = msgpack.unpackb(data, strict_map_key=False)
    return _KINDS[tag](*fields)


# ------------------------------------------------------------------------------------------------ errors
# The exceptions that cross as data: kind -> how to build it again from (message, details)
_ERRORS = {
    "PromptTooLongError": lambda m, d: PromptTooLongError(m, d["prompt_tokens"], d["limit"]),
    "InvalidParameterError": lambda m, d: InvalidParameterError(d["param"], m),
    "RequestRefused": lambda m, d: RequestRefused(m),
    "AdapterError": lambda m, d: AdapterError(d["adapter"], d["problem"]),
    "ModelLoadError": lambda m, d: ModelLoadError(m),
    "FileNotFoundError": lambda m, d: FileNotFoundError(m),
    "ValueError": lambda m, d: ValueError(m),
}


def wire_error(exc: BaseException) -> list:
    """[kind, message, details] of `exc`: the kinds above by their exact type, any other as a RuntimeError naming
    its type."""
    kind = type(exc).__name__
    if kind not in _ERRORS or type(exc).__module__.split(".")[0] not in ("engine_ext", "builtins"):
        return ["RuntimeError", f"{kind}: {exc}", {}]
    details = {name: getattr(exc, name) for name in ("prompt_tokens", "limit", "param", "adapter", "problem")
               if hasattr(exc, name)}
    return [kind, str(exc), details]


def error_of(wire: list) -> Exception:
    kind, message, details = wire
    build = _ERRORS.get(kind)
    return build(message, details) if build is not None else RuntimeError(message)
