"""One request's trip through an LLM replica: gate, first chunk, then JSON or SSE.

`begin()` runs up to the replica's first chunk so that failures before any token (adapter
disabled meanwhile, prompt too long, no replica) are still ordinary HTTP errors.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, AsyncIterator, Optional

from deployments import responses as R
from deployments.errors import APIError, error_body
from deployments.protocol import GenerateRequest, error_chunk

if TYPE_CHECKING:
    from deployments.openai_api import IngressDeps

__all__ = ["StreamRun"]

logger = logging.getLogger(__name__)


class StreamRun:
    def __init__(self, deps: "IngressDeps", req: GenerateRequest, tenant: str, adapter: str, chat: bool,
                 model: str, include_usage: bool = False):
        self.deps, self.req, self.tenant, self.adapter, self.chat = deps, req, tenant, adapter, chat
        self.model, self.include_usage = model, include_usage
        self.labels = (adapter, tenant)
        self._it: Optional[AsyncIterator[dict]] = None
        self._gated = False
        self._t0 = deps.clock()
        self._last_token_t: Optional[float] = None
        self._first_token_t: Optional[float] = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.finish_reason: Optional[str] = None
        self.replica: Optional[str] = None
        self.adapter_hit: Optional[bool] = None

    # ------------------------------------------------------------------ start
    async def begin(self) -> None:
        key = self.req.adapter_key
        if key is not None:
            try:
                self._gated = await self.deps.gate.acquire(key)
            except asyncio.TimeoutError:
                raise APIError(429, f"adapter {self.adapter!r} is still loading; retry shortly",
                               code="adapter_loading", headers={"Retry-After": "1"}) from None
        try:
            self._it = self.deps.llm.stream(self.req).__aiter__()
            first = await self._it.__anext__()
        except StopAsyncIteration:
            first = error_chunk(500, "internal_error", "replica returned no output")
        except Exception as e:  # noqa: BLE001 - Ray/transport errors: the service, not the request, failed
            logger.exception("request %s failed before its first chunk", self.req.request_id)
            first = error_chunk(503, "service_unavailable", f"no replica could serve the request: {type(e).__name__}")
        if first["type"] == "error":
            await self._fail(APIError(first["status"], first["message"], code=first["code"]))
        self._on_start(first)

    async def _fail(self, err: APIError) -> None:
        self._ungate()
        await self._close()
        raise err

    def _ungate(self) -> None:
        if self._gated:
            self._gated = False
            self.deps.gate.release(self.req.adapter_key)

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
        self.adapter_hit = first.get("adapter_hit")

    async def _close(self) -> None:
        it, self._it = self._it, None
        if it is not None and hasattr(it, "aclose"):
            try:
                await it.aclose()
            except Exception:  # noqa: BLE001 - closing is best effort
                logger.debug("closing replica stream failed", exc_info=True)

    # ------------------------------------------------------------------ chunks
    async def _deltas(self) -> AsyncIterator[str]:
        """The remaining text deltas; records metrics and the end state."""
        m, clock = self.deps.metrics, self.deps.clock
        status, code = "200", None
        try:
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
                    yield chunk["text"]
                elif kind == "end":
                    self._on_end(chunk)
                elif kind == "error":
                    status, code = str(chunk["status"]), chunk["code"]
                    raise APIError(chunk["status"], chunk["message"], code=chunk["code"])
        except APIError:
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
            await self._close()

    def _on_end(self, chunk: dict) -> None:
        m = self.deps.metrics
        self.finish_reason = chunk["finish_reason"]
        self.prompt_tokens = int(chunk.get("prompt_tokens", self.prompt_tokens))
        self.completion_tokens = int(chunk.get("completion_tokens", 0))
        m.prompt_tokens.labels(*self.labels).inc(self.prompt_tokens)
        m.completion_tokens.labels(*self.labels).inc(self.completion_tokens)
        if self._first_token_t is not None and self.completion_tokens > 1:
            elapsed = max(1e-6, self.deps.clock() - self._first_token_t)
            m.tps.labels(*self.labels).observe((self.completion_tokens - 1) / elapsed)
        if chunk.get("snapshot") and self.replica:
            m.replicas.update(self.replica, chunk["snapshot"])

    # ------------------------------------------------------------------ outputs
    def headers(self) -> dict[str, str]:
        """Which replica served the request and whether it already held the adapter (benchmarks)."""
        out = {"x-request-id": self.req.request_id}
        if self.req.adapter_key:
            out["x-loraserve-adapter"] = self.req.adapter_key  # name@version: which canary/version served
        if self.replica:
            out["x-loraserve-replica"] = str(self.replica)
        if self.adapter_hit is not None:
            out["x-loraserve-adapter-hit"] = "1" if self.adapter_hit else "0"
        return out

    async def collect(self) -> dict[str, Any]:
        text = "".join([t async for t in self._deltas()])
        use = R.usage(self.prompt_tokens, self.completion_tokens)
        make = R.chat_completion if self.chat else R.completion
        return make(self.req.request_id, self.model, text, self.finish_reason or "stop", use)

    async def sse(self) -> AsyncIterator[str]:
        rid, created = self.req.request_id, int(self.deps.clock())
        if self.chat:
            yield R.sse(R.chat_chunk(rid, self.model, {"role": "assistant", "content": ""}, None, created))
        try:
            async for text in self._deltas():
                if not text:
                    continue
                if self.chat:
                    yield R.sse(R.chat_chunk(rid, self.model, {"content": text}, None, created))
                else:
                    yield R.sse(R.completion_chunk(rid, self.model, text, None, created))
        except APIError as err:
            yield R.sse(error_body(err.status, err.message, err.code))
            yield R.SSE_DONE
            return
        finish = self.finish_reason or "stop"
        if self.chat:
            last = R.chat_chunk(rid, self.model, {}, finish, created)
        else:
            last = R.completion_chunk(rid, self.model, "", finish, created)
        yield R.sse(last)
        if self.include_usage:
            tail = {**last, "choices": [], "usage": R.usage(self.prompt_tokens, self.completion_tokens)}
            yield R.sse(tail)
        yield R.SSE_DONE
