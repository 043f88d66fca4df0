"""One request's trip through an LLM replica: gate, first chunk, then JSON or SSE.

`begin()` runs up to the replica's first chunk so that failures before any token (adapter
disabled meanwhile, prompt too long, no replica) are still ordinary HTTP errors. A replica that
fails (`ReplicaUnavailable`) before the client has seen a token is replaced by another without the
client noticing; one that fails after ends the stream with an OpenAI-format error event.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Optional

from deployments.data_plane import responses as R
from deployments.data_plane.errors import APIError, error_body, retry_after
from deployments.data_plane.protocol import GenerateRequest, ReplicaUnavailable, error_chunk

if TYPE_CHECKING:
    from deployments.data_plane.openai_api import IngressDeps

__all__ = ["StreamRun"]

logger = logging.getLogger(__name__)


@dataclass
class _Choice:
    parts: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # replica entries, see deployments.data_plane.protocol
    chars: int = 0
    finish_reason: Optional[str] = None
    tokens: int = 0


def _chunk_error(chunk: dict) -> APIError:
    """A replica's error chunk as the HTTP error it stands for (a 503 says when to retry)."""
    retry = chunk.get("retry_after_s")
    headers = {"Retry-After": retry_after(retry)} if retry is not None else None
    return APIError(chunk["status"], chunk["message"], code=chunk["code"], param=chunk.get("param"), headers=headers)


class StreamRun:
    def __init__(self, deps: "IngressDeps", req: GenerateRequest, tenant: str, adapter: str, chat: bool,
                 model: str, include_usage: bool = False, logprobs: bool = False, redact: bool = False,
                 request_id_header: bool = True):
        """`tenant`, `adapter`: their labels in /metrics; `request_id_header`: answer with `x-request-id` (not
        when the request carried one, which Serve's proxy echoes itself)."""
        self.deps, self.req, self.tenant, self.adapter, self.chat = deps, req, tenant, adapter, chat
        self.model, self.include_usage, self.want_logprobs, self.redact = model, include_usage, logprobs, redact
        self.request_id_header = request_id_header
        self.labels = (adapter, tenant)
        self._it: Optional[AsyncIterator[dict]] = None
        self._gated = False
        self._t0 = deps.clock()
        self._last_token_t: Optional[float] = None
        self._first_token_t: Optional[float] = None
        self._sent = False  # a token reached the client: from here on a failure cannot be hidden
        self._running = False
        self._counted: Optional[str] = None  # the replica this request counts as running on (metrics)
        self.retries = 0
        self.prompt_tokens = 0
        self.choices = [_Choice() for _ in range(req.num_choices)]
        self.replica: Optional[str] = None
        self.adapter_hit: Optional[bool] = None

    @property
    def completion_tokens(self) -> int:
        return sum(c.tokens for c in self.choices)

    @property
    def finish_reason(self) -> Optional[str]:
        return self.choices[0].finish_reason

    # ------------------------------------------------------------------ start
    async def begin(self) -> None:
        key = self.req.adapter_key
        if key is not None:
            try:
                self._gated = await self.deps.gate.acquire(key)
            except asyncio.TimeoutError:
                raise APIError(429, f"adapter {self.adapter!r} is still loading; retry shortly",
                               code="adapter_loading", headers={"Retry-After": "1"}) from None
        self._running = True
        self.deps.metrics.running.inc()
        first = await self._open()
        if first["type"] == "error":
            await self._fail(_chunk_error(first))
        self._on_start(first)

    async def _open(self) -> dict:
        """The first chunk of a replica's stream; a replica that fails before it is replaced, up to deps.retries times."""
        for attempt in range(self.deps.retries + 1):
            # A retry gets its own engine request id: the failed attempt's may still be aborting on that replica.
            req = self.req if not self.retries else dataclasses.replace(
                self.req, request_id=f"{self.req.request_id}-retry{self.retries}")
            self._it = self.deps.llm.stream(req).__aiter__()
            try:
                return await self._it.__anext__()
            except StopAsyncIteration:
                return error_chunk(500, "internal_error", "replica returned no output")
            except ReplicaUnavailable as e:
                await self._close()
                if attempt == self.deps.retries:
                    return error_chunk(503, "service_unavailable", f"no replica could serve the request: {e}")
                self.retries += 1
                self.deps.metrics.retries.labels("before_first_token").inc()
                logger.warning("request %s: replica failed before its first token (%s); retrying",
                               self.req.request_id, e)
                await asyncio.sleep(self.deps.retry_backoff_s * (attempt + 1))
            except Exception as e:  # noqa: BLE001 - transport errors: the service, not the request, failed
                logger.exception("request %s failed before its first chunk", self.req.request_id)
                return error_chunk(503, "service_unavailable", f"no replica could serve the request: {type(e).__name__}")
        raise AssertionError("unreachable")

    async def _fail(self, err: APIError) -> None:
        self._ungate()
        self._stop_running()
        await self._close()
        raise err

    def _ungate(self) -> None:
        if self._gated:
            self._gated = False
            self.deps.gate.release(self.req.adapter_key)

    def _stop_running(self) -> None:
        m = self.deps.metrics
        if self._running:
            self._running = False
            m.running.dec()
        if self._counted is not None:
            m.replica_running.labels(self._counted).dec()
            self._counted = None

    def _on_start(self, first: dict) -> None:
        m = self.deps.metrics
        if self.req.adapter_key is not None:
            self.deps.gate.mark_warm(self.req.adapter_key)
        self._ungate()
        m.queue.labels(*self.labels).observe(max(0.0, first.get("started_at", self._t0) - self.req.submitted_at))
        if first.get("num_running") is not None:
            m.batch.observe(first["num_running"])
        self.prompt_tokens = int(first.get("prompt_tokens", 0))
        self.replica = first.get("replica")
        if self.replica is not None:
            self._counted = self.replica
            m.replica_running.labels(self.replica).inc()
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
        if self._counted is not None:
            self.deps.metrics.replica_running.labels(self._counted).dec()
            self._counted = None
        self.retries += 1
        self.deps.metrics.retries.labels("before_first_token").inc()
        self.choices = [_Choice() for _ in self.choices]
        self._first_token_t = None
        first = await self._open()
        if first["type"] == "error":
            raise _chunk_error(first)
        self._on_start(first)

    # ------------------------------------------------------------------ chunks
    async def _deltas(self) -> AsyncIterator[tuple[int, str, Optional[list]]]:
        """The remaining deltas as (choice index, text, logprob entries); records metrics and the end state."""
        m, clock = self.deps.metrics, self.deps.clock
        status, code = "200", None
        try:
            while True:
                try:
                    async for ev in self._chunks():
                        yield ev
                    break
                except ReplicaUnavailable as e:
                    if self._sent or self.retries >= self.deps.retries:
                        m.retries.labels("after_first_token").inc()
                        raise APIError(503, f"the replica serving this request failed: {e}",
                                       code="replica_failed") from None
                    await self._restart(e)
        except APIError as err:
            status, code = str(err.status), err.code
            raise
        except Exception as e:  # noqa: BLE001
            status, code = "500", "internal_error"
            logger.exception("request %s failed mid-stream", self.req.request_id)
            raise APIError(500, f"generation failed: {type(e).__name__}", code="internal_error") from None
        finally:
            m.requests.labels(*self.labels, status).inc()
            if code is not None:
                m.errors.labels(*self.labels, code).inc()
            m.e2e.labels(*self.labels).observe(clock() - self._t0)
            self._stop_running()
            await self._close()

    async def _chunks(self) -> AsyncIterator[tuple[int, str, Optional[list]]]:
        m, clock = self.deps.metrics, self.deps.clock
        assert self._it is not None
        async for chunk in self._it:
            kind = chunk["type"]
            if kind == "delta":
                now = clock()
                if self._first_token_t is None:
                    self._first_token_t = now
                    m.ttft.labels(*self.labels).observe(now - self._t0)
                else:
                    m.itl.labels(*self.labels).observe((now - self._last_token_t) / max(1, chunk["num_tokens"]))
                self._last_token_t = now
                c = self.choices[chunk.get("index", 0)]
                c.parts.append(chunk["text"])
                entries = chunk.get("logprobs") if self.want_logprobs else None
                if entries:
                    c.logprobs.extend(entries)
                yield chunk.get("index", 0), chunk["text"], entries
                c.chars += len(chunk["text"])
            elif kind == "end":
                self._on_end(chunk)
            elif kind == "error":
                raise _chunk_error(chunk)

    def _on_end(self, chunk: dict) -> None:
        m = self.deps.metrics
        for i, reason in chunk.get("finish_reasons", {}).items():
            self.choices[int(i)].finish_reason = reason
        self.choices[0].finish_reason = self.choices[0].finish_reason or chunk.get("finish_reason")
        for i, n in chunk.get("choice_tokens", {0: chunk.get("completion_tokens", 0)}).items():
            self.choices[int(i)].tokens = int(n)
        self.prompt_tokens = int(chunk.get("prompt_tokens", self.prompt_tokens))
        m.prompt_tokens.labels(*self.labels).inc(self.prompt_tokens)
        m.completion_tokens.labels(*self.labels).inc(self.completion_tokens)
        if self._first_token_t is not None and self.completion_tokens > 1:
            elapsed = max(1e-6, self.deps.clock() - self._first_token_t)
            m.tps.labels(*self.labels).observe((self.completion_tokens - 1) / elapsed)
        if chunk.get("snapshot") and self.replica:
            snapshot = dict(chunk["snapshot"])
            if self.redact:  # a tenant-private adapter's name stays out of /metrics
                snapshot.pop("adapters", None)
            m.replicas.update(self.replica, snapshot)

    # ------------------------------------------------------------------ outputs
    def headers(self) -> dict[str, str]:
        """Which replica served the request and whether it already held the adapter (benchmarks)."""
        out = {"x-request-id": self.req.request_id} if self.request_id_header else {}
        if self.req.adapter_key:
            out["x-loraserve-adapter"] = self.req.adapter_key  # name@version: which canary/version served
        if self.replica:
            out["x-loraserve-replica"] = str(self.replica)
        if self.adapter_hit is not None:
            out["x-loraserve-adapter-hit"] = "1" if self.adapter_hit else "0"
        if self.retries:
            out["x-loraserve-retries"] = str(self.retries)
        return out

    def _logprobs(self, entries: Optional[list], offset: int) -> Optional[dict]:
        if not self.want_logprobs:
            return None
        return R.chat_logprobs(entries or []) if self.chat else R.completion_logprobs(entries or [], offset)

    async def collect(self) -> dict[str, Any]:
        async for _ in self._deltas():  # state lives in self.choices (a retry resets it)
            pass
        make_choice = R.chat_choice if self.chat else R.completion_choice
        choices = [make_choice(i, "".join(c.parts), c.finish_reason or "stop", self._logprobs(c.logprobs, 0))
                   for i, c in enumerate(self.choices)]
        use = R.usage(self.prompt_tokens, self.completion_tokens)
        return (R.chat_completion if self.chat else R.completion)(self.req.request_id, self.model, choices, use)

    async def sse(self) -> AsyncIterator[str]:
        rid, created = self.req.request_id, int(self.deps.clock())
        if self.chat:
            for i in range(len(self.choices)):
                yield R.sse(R.chat_chunk(rid, self.model, i, {"role": "assistant", "content": ""}, None, created))
        try:
            async for i, text, entries in self._deltas():
                if not text and not entries:
                    continue
                self._sent = True
                if self.chat:
                    yield R.sse(R.chat_chunk(rid, self.model, i, {"content": text}, None, created,
                                             self._logprobs(entries, 0)))
                else:
                    offset = self.choices[i].chars
                    yield R.sse(R.completion_chunk(rid, self.model, i, text, None, created,
                                                   self._logprobs(entries, offset)))
        except APIError as err:
            yield R.sse(error_body(err.status, err.message, err.code))
            yield R.SSE_DONE
            return
        last = None
        for i, c in enumerate(self.choices):
            finish = c.finish_reason or "stop"
            if self.chat:
                last = R.chat_chunk(rid, self.model, i, {}, finish, created)
            else:
                last = R.completion_chunk(rid, self.model, i, "", finish, created)
            yield R.sse(last)
        if self.include_usage:
            tail = {**last, "choices": [], "usage": R.usage(self.prompt_tokens, self.completion_tokens)}
            yield R.sse(tail)
        yield R.SSE_DONE
