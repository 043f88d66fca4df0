"""AsyncLLMEngine: the same `step()` loop on a background thread, with asyncio streams per request."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator

from .config import EngineConfig
from .llm_engine import LLMEngine, StepContext
from .sampling_params import SamplingParams
from .sequence import RequestOutput

logger = logging.getLogger(__name__)
_FAILED = object()


def joined(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one: the last, with what each added (new tokens, their text and
    log-probabilities) joined in order."""
    last = outputs[-1]
    if len(outputs) == 1:
        return last
    logprobs = None if last.new_logprobs is None else [lp for o in outputs for lp in o.new_logprobs or ()]
    return dataclasses.replace(last, new_token_ids=[t for o in outputs for t in o.new_token_ids],
                               delta_text="".join(o.delta_text for o in outputs), new_logprobs=logprobs)


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None):
        self.engine = engine or LLMEngine(config)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # New requests apart from other commands: a speculative cycle takes them in between its passes
        # (StepContext.arrivals); aborts and the rest wait for the step to end.
        self._arrivals: queue.SimpleQueue = queue.SimpleQueue()
        # First tokens computed in a cycle's drafting pass go out before the step ends (StepContext.publish)
        self._context = StepContext(arrivals=self._take_arrivals, publish=self._publish)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # Per event loop, the items handed out and not yet put on their streams' queues: one wakeup of a loop carries
        # every output a step (or several, while the loop is busy) gave its streams, not one wakeup per output
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        self._outbox_lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = False
        self._ids = itertools.count()
        self._lock = threading.Lock()  # serialises engine mutations from other threads with step()
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # ------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        while not self._stopped:
            self._take_arrivals()  # before the other commands: an abort follows its request's arrival
            while not self._commands.empty():
                self._commands.get()()
            if not self.engine.has_unfinished_requests:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                with self._lock:
                    outs = self.engine.step(self._context)
            except Exception as e:  # never die silently: fail every open stream, keep the loop alive
                logger.exception("engine step failed")
                self._fail_all(e)
                continue
            self._publish(outs)

    def _publish(self, outs) -> None:
        """Hand outputs to their streams: a step's, and first tokens published during one (StepContext.publish)."""
        self._deliver([(out.request_id, out) for out in outs])

    def _deliver(self, items: list[tuple[str, object]]) -> None:
        """Queue (request id, item) pairs for their streams, in order, and wake each event loop that had nothing
        queued. Waking a loop once per output cost the engine thread about 21 us an output at 128 streams (a
        cross-thread wakeup each, and the loop thread taking the GIL for each), bench/async_host.py."""
        wake = []
        with self._outbox_lock:
            for request_id, item in items:
                target = self._streams.get(request_id)
                if target is None:
                    continue
                loop, q = target
                box = self._outbox.get(loop)
                if box is None:
                    box = self._outbox[loop] = []
                    wake.append(loop)
                box.append((q, item))
        for loop in wake:
            try:
                loop.call_soon_threadsafe(self._drain, loop)
            except RuntimeError:  # the loop closed: nothing will read its streams
                with self._outbox_lock:
                    self._outbox.pop(loop, None)

    def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        """On `loop`: put everything queued for its streams on their queues."""
        with self._outbox_lock:
            box = self._outbox.pop(loop, [])
        for q, item in box:
            q.put_nowait(item)

    def _fail_all(self, error: Exception) -> None:
        self._deliver([(rid, (_FAILED, error)) for rid in self.engine.abort_all()])

    def _take_arrivals(self) -> None:
        while not self._arrivals.empty():
            self._arrivals.get()()

    def _submit(self, fn) -> None:
        self._commands.put(fn)
        self._wake.set()

    # ------------------------------------------------------------ public API
    async def generate(self, prompt: str | None = None, *, prompt_token_ids: list[int] | None = None,
                       sampling_params: SamplingParams | None = None, adapter_name: str | None = None,
                       request_id: str | None = None, share_prompt_with: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; `share_prompt_with`: see LLMEngine.add_request (requests are added in
        the order their generators start)."""
        request_id = request_id or f"areq-{next(self._ids)}"
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        added = asyncio.get_running_loop().create_future()
        loop = asyncio.get_running_loop()

        def add() -> None:
            try:
                self.engine.add_request(request_id, prompt, prompt_token_ids, sampling_params, adapter_name,
                                        share_prompt_with)
                loop.call_soon_threadsafe(added.set_result, None)
            except Exception as e:
                loop.call_soon_threadsafe(added.set_exception, e)

        try:
            self._arrivals.put(add)
            self._wake.set()
            await added  # validation errors surface here, before any token
            held = None
            while True:
                item, held = (held, None) if held is not None else (await q.get(), None)
                # A consumer behind the engine takes every output waiting for it as one (its deltas joined): one
                # chunk for the server to send instead of one per step it missed
                if isinstance(item, RequestOutput) and not item.finished and not q.empty():
                    waiting = [item]
                    while not waiting[-1].finished and not q.empty():
                        later = q.get_nowait()
                        if not isinstance(later, RequestOutput):  # a failure: what came before it goes out first
                            held = later
                            break
                        waiting.append(later)
                    item = joined(waiting)
                if not isinstance(item, RequestOutput):
                    raise RuntimeError(f"engine failed while serving {request_id}: {item[1]}")
                yield item
                if item.finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not added.done() or added.cancelled() or added.exception() is None:
                self._submit(lambda: self.engine.abort_request(request_id))

    async def abort(self, request_id: str) -> None:
        self._submit(lambda: self.engine.abort_request(request_id))

    def add_adapter(self, name: str, path: str, pinned: bool = False) -> None:
        # Parsing runs on the caller's thread; only the registration takes the engine lock.
        self.engine.add_adapter(name, path, pinned)

    def remove_adapter(self, name: str) -> None:
        with self._lock:
            self.engine.remove_adapter(name)

    def drop_cached_prefixes(self, name: str) -> None:
        """Queued for the engine thread, which drops them between steps: the caller (an event loop) never waits
        for a step to end."""
        self._submit(lambda: self.engine.drop_cached_prefixes(name))

    def has_adapter(self, name: str) -> bool:
        return self.engine.has_adapter(name)

    def pin_adapter(self, name: str, pinned: bool) -> None:
        self.engine.pin_adapter(name, pinned)

    def host_adapters(self) -> list[str]:
        return self.engine.host_adapters()

    def set_host_eviction(self, choose) -> None:
        self.engine.set_host_eviction(choose)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def is_alive(self) -> bool:
        """The step loop's thread is running (it outlives a failed step: see `_loop`) and so is every tensor-parallel
        rank (a dead one fails every step: Serve replaces the replica on this answer)."""
        return self._thread.is_alive() and self.engine.ranks.alive()

    def stats(self) -> dict:
        with self._lock:
            return self.engine.stats()

    def shutdown(self, close_engine: bool = True) -> None:
        """Stop the loop thread, then close the engine (`close_engine`: False leaves it usable, e.g. by another
        AsyncLLMEngine)."""
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=5)
        if close_engine:
            self.engine.close()
