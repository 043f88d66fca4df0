"""One request's trip through the LLM replicas: the cold-load gate, the first chunk, then the deltas.

`begin()` runs up to the replica's first chunk so that failures before any token (adapter disabled meanwhile,
prompt too long, no replica) are still ordinary HTTP errors. A replica that fails (`ReplicaUnavailable`: the replica
gone, or its engine core: an error chunk coded as one of REPLICA_FAILURES) before the client has seen a token is
replaced by another without the client noticing; one that fails after ends the stream with an OpenAI-format error.
What the session learns is kept in `choices` and its fields; what /metrics should know goes to its observer
(`StreamMetrics`); the renderers (`renderers.py`) turn the deltas into JSON or SSE.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from deployments.data_plane.errors import APIError, chunk_error
from deployments.data_plane.protocol import GenerateRequest, ReplicaUnavailable, error_chunk
from deployments.data_plane.rate_limit import ColdLoadGate
from deployments.data_plane.stream_metrics import StreamMetrics

__all__ = ["ReplicaSession", "Choice", "Delta", "REPLICA_FAILURES"]

logger = logging.getLogger(__name__)
# Error chunks that mean the replica failed, not the request (deployments.replica.errors): retried elsewhere
REPLICA_FAILURES = frozenset({"engine_unavailable"})


def _raise_if_replica_failed(chunk: dict) -> dict:
    if chunk["type"] == "error" and chunk.get("code") in REPLICA_FAILURES:
        raise ReplicaUnavailable(chunk["message"])
    return chunk


@dataclass
class Choice:
    parts: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # replica entries, see deployments.data_plane.protocol
    chars: int = 0  # characters of text before the delta being rendered (completion logprobs' text_offset)
    finish_reason: Optional[str] = None
    tokens: int = 0


@dataclass(frozen=True)
class Delta:
    index: int  # the choice
    text: str
    logprobs: Optional[list]  # the delta's logprob entries, None unless asked for


@dataclass(frozen=True)
class Retries:
    limit: int = 3  # replicas a request may be moved to before its first token reaches the client
    backoff_s: float = 0.2  # the wait before the n-th retry is n times this


class ReplicaSession:
    def __init__(self, llm: Any, gate: ColdLoadGate, req: GenerateRequest, observer: StreamMetrics,
                 retries: Retries = Retries(), want_logprobs: bool = False):
        """`llm`: `stream(req)` of replica chunks (openai_api.LLMClient)."""
        self.llm, self.gate, self.req, self.observe, self.policy = llm, gate, req, observer, retries
        self.want_logprobs = want_logprobs
        self.choices = [Choice() for _ in range(req.num_choices)]
        self.prompt_tokens = 0
        self.replica: Optional[str] = None
        self.adapter_hit: Optional[bool] = None
        self.retries = 0
        self.sent = False  # a token reached the client: from here on a failure cannot be hidden
        self._it: Optional[AsyncIterator[dict]] = None
        self._gated = False

    @property
    def completion_tokens(self) -> int:
        return sum(c.tokens for c in self.choices)

    # ------------------------------------------------------------------ start
    async def begin(self) -> None:
        """Up to the replica's first chunk; raises APIError (nothing streamed yet)."""
        key = self.req.adapter_key
        if key is not None:
            try:
                self._gated = await self.gate.acquire(key)
            except asyncio.TimeoutError:
                raise APIError(429, f"adapter {key!r} is still loading; retry shortly", code="adapter_loading",
                               headers={"Retry-After": "1"}) from None
        self.observe.running()
        first = await self._open()
        if first["type"] == "error":
            self._ungate()
            self.observe.stopped()
            await self._close()
            raise chunk_error(first)
        self._on_start(first)

    async def _open(self) -> dict:
        """The first chunk of a replica's stream; a replica that fails before it is replaced, up to the limit."""
        for attempt in range(self.policy.limit + 1):
            # A retry gets its own engine request id: the failed attempt's may still be aborting on that replica.
            req = self.req if not self.retries else dataclasses.replace(
                self.req, request_id=f"{self.req.request_id}-retry{self.retries}")
            self._it = self.llm.stream(req).__aiter__()
            try:
                return _raise_if_replica_failed(await self._it.__anext__())
            except StopAsyncIteration:
                return error_chunk(500, "internal_error", "replica returned no output")
            except ReplicaUnavailable as e:
                await self._close()
                if attempt == self.policy.limit:
                    return error_chunk(503, "service_unavailable", f"no replica could serve the request: {e}")
                self.retries += 1
                self.observe.retried("before_first_token")
                logger.warning("request %s: replica failed before its first token (%s); retrying",
                               self.req.request_id, e)
                await asyncio.sleep(self.policy.backoff_s * (attempt + 1))
            except Exception as e:  # noqa: BLE001 - transport errors: the service, not the request, failed
                logger.exception("request %s failed before its first chunk", self.req.request_id)
                return error_chunk(503, "service_unavailable", f"no replica could serve the request: {type(e).__name__}")
        raise AssertionError("unreachable")

    def _ungate(self) -> None:
        if self._gated:
            self._gated = False
            self.gate.release(self.req.adapter_key)

    def _on_start(self, first: dict) -> None:
        if self.req.adapter_key is not None:
            self.gate.mark_warm(self.req.adapter_key)
        self._ungate()
        self.observe.on_replica(first, self.req.submitted_at)
        self.prompt_tokens = int(first.get("prompt_tokens", 0))
        self.replica = first.get("replica")
        self.adapter_hit = first.get("adapter_hit")

    async def _close(self) -> None:
        it, self._it = self._it, None
        if it is not None and hasattr(it, "aclose"):
            try:
                await it.aclose()
            except Exception:  # noqa: BLE001 - closing is best effort
                logger.debug("closing replica stream failed", exc_info=True)

    async def _restart(self, reason: Exception) -> None:
        """The replica failed before the client saw a token: start over on another one."""
        logger.warning("request %s: replica %s failed before the client saw a token (%s); retrying",
                       self.req.request_id, self.replica, reason)
        await self._close()
        self.observe.off_replica()
        self.retries += 1
        self.observe.retried("before_first_token")
        self.choices = [Choice() for _ in self.choices]
        first = await self._open()
        if first["type"] == "error":
            raise chunk_error(first)
        self._on_start(first)

    # ------------------------------------------------------------------ deltas
    async def deltas(self) -> AsyncIterator[Delta]:
        """The remaining deltas; the end state lands in `choices`. Raises APIError when the request fails."""
        status, code = 200, None
        try:
            while True:
                try:
                    async for delta in self._chunks():
                        yield delta
                    break
                except ReplicaUnavailable as e:
                    if self.sent or self.retries >= self.policy.limit:
                        self.observe.retried("after_first_token")
                        raise APIError(503, f"the replica serving this request failed: {e}",
                                       code="replica_failed") from None
                    await self._restart(e)
        except APIError as err:
            status, code = err.status, err.code
            raise
        except Exception as e:  # noqa: BLE001
            status, code = 500, "internal_error"
            logger.exception("request %s failed mid-stream", self.req.request_id)
            raise APIError(500, f"generation failed: {type(e).__name__}", code="internal_error") from None
        finally:
            self.observe.finished(status, code)
            await self._close()

    async def _chunks(self) -> AsyncIterator[Delta]:
        assert self._it is not None
        async for chunk in self._it:
            kind = chunk["type"]
            if kind == "delta":
                self.observe.token(chunk["num_tokens"])
                c = self.choices[chunk.get("index", 0)]
                c.parts.append(chunk["text"])
                entries = chunk.get("logprobs") if self.want_logprobs else None
                if entries:
                    c.logprobs.extend(entries)
                yield Delta(chunk.get("index", 0), chunk["text"], entries)
                c.chars += len(chunk["text"])
            elif kind == "end":
                self._on_end(chunk)
            elif kind == "error":
                raise chunk_error(_raise_if_replica_failed(chunk))

    def _on_end(self, chunk: dict) -> None:
        for i, reason in chunk.get("finish_reasons", {}).items():
            self.choices[int(i)].finish_reason = reason
        self.choices[0].finish_reason = self.choices[0].finish_reason or chunk.get("finish_reason")
        for i, n in chunk.get("choice_tokens", {0: chunk.get("completion_tokens", 0)}).items():
            self.choices[int(i)].tokens = int(n)
        self.prompt_tokens = int(chunk.get("prompt_tokens", self.prompt_tokens))
        self.observe.ended(self.prompt_tokens, self.completion_tokens, self.replica, chunk.get("snapshot"))
