"""AsyncLLMEngine: asyncio streams of requests, as the client of an engine core (core/) that runs the step loop in a
process of its own (EngineConfig.engine_process: the client's event loop and the step loop never share an
interpreter) or on a thread of this one. Either way the same messages pass (core/messages.py), one per step with
every output of that step, and the client detokenizes and applies stop strings on its consumers' time.

    client (this process)                                     engine core (a process, or a thread here)
    generate/abort/adapters --AddRequest, Abort, ...-->   EngineCore: apply messages | LLMEngine.step()
    RequestStream per request <----- StepOutputs -----    (one per step: ids, token ids, finishes, logprobs)
    text, stop strings, RequestOutput
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import asdict
from typing import NamedTuple

from .config import EngineConfig, SpecConfig
from .core.messages import (Abort, AddAdapter, AddRequest, AdapterState, DropCachedPrefixes, Failed, GetStats,
                            PinAdapter, Profile, RankHostEviction, Refused, RemoveAdapter, Reply, SetSpeculation,
                            StepOutputs, error_of)
from .core.process_core import CoreLaunch, ProcessCore
from .core.request_stream import RequestStream
from .core.thread_core import ThreadCore
from .detokenizer import Detokenizer
from .errors import EngineDeadError
from .llm_engine import LLMEngine
from .sampling_params import SamplingParams
from .sequence import RequestOutput
from .tokenizer import load_tokenizer

__all__ = ["AsyncLLMEngine"]


class _Dead(NamedTuple):
    error: EngineDeadError


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None, *, engine_factory: str | None = None,
                 launch: CoreLaunch | None = None):
        """engine: for a core on a thread, an engine built with detokenize=False (else one is built from `config`).
        engine_factory: "module:function" building the core's engine from `config` where the core runs (a
        benchmark's stubbed model). launch: how a core process starts (default: this interpreter, `python -m`)."""
        self.config = config
        self._streams: dict[str, RequestStream] = {}
        self._loops: dict[asyncio.AbstractEventLoop, int] = {}  # streams on each event loop
        # Per event loop, the core's messages not yet handed to its streams: one wakeup of a loop carries every
        # message that came while it was busy, not one wakeup per message
        self._outbox: dict[asyncio.AbstractEventLoop, list[NamedTuple]] = {}
        self._outbox_lock = threading.Lock()
        self._calls: dict[int, tuple[Future, bool]] = {}  # call id -> (its future, its reply is the adapter state)
        self._ids, self._call_ids = itertools.count(), itertools.count()
        self._dead: EngineDeadError | None = None
        self._dead_callbacks: list[Callable[[EngineDeadError], None]] = []
        if config.engine_process:
            if engine is not None:
                raise ValueError("an engine core process builds its own engine: pass engine_factory, not an engine")
            self.engine = None
            self.tokenizer = load_tokenizer(config.model)
            self._core = ProcessCore(config, self._on_message, self._on_dead, engine_factory, launch or CoreLaunch())
        else:
            if engine is None:
                from .core.process import build_engine

                engine = build_engine(config, engine_factory)
            self.engine = engine  # the engine itself, for tests that look inside (in-process only)
            self.tokenizer = engine.tokenizer
            self._core = ThreadCore(engine, self._on_message, self._on_dead)
        ready = self._core.ready
        self.max_model_len, self.startup = ready.max_model_len, ready.startup
        self._adapters = AdapterState(ready.registered, ready.host_adapters)
        self._detokenizer = Detokenizer(self.tokenizer) if self.tokenizer is not None else None

    @property
    def core_pid(self) -> int | None:
        """The engine core's process id (None: it runs on a thread of this process)."""
        return self._core.pid

    # ------------------------------------------------------------ requests
    async def generate(self, prompt: str | None = None, *, prompt_token_ids: list[int] | None = None,
                       sampling_params: SamplingParams | None = None, adapter_name: str | None = None,
                       request_id: str | None = None, share_prompt_with: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs: each carries every token the core produced for it since the last one.
        Refusals (the engine's add_request errors) raise before any output. `share_prompt_with`: see
        LLMEngine.add_request (requests reach the core in the order their generators start)."""
        request_id = request_id or f"areq-{next(self._ids)}"
        params = sampling_params or SamplingParams()
        ids = self._prompt_ids(prompt, prompt_token_ids)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        loop = asyncio.get_running_loop()
        text = self._detokenizer.text_state(params.stop) if self._detokenizer is not None else None
        if params.stop and text is None:
            raise ValueError("stop strings need a model with a tokenizer")
        stream = RequestStream(request_id, ids, params, adapter_name, loop, text)
        self._open(stream)
        try:
            self._check_alive()  # after _open: a death from now on reaches this stream
            # The core applies no stop strings: this client does, on the text
            fields = asdict(params) | {"stop": []}
            self._core.send(AddRequest(request_id, ids, fields, adapter_name, share_prompt_with))
            while True:
                out = await stream.next()
                yield out
                if out.finished:
                    return
        finally:
            self._close(stream)
            if not stream.settled:  # a consumer gone, or a stop string: end it in the core
                try:
                    self._core.send(Abort(request_id))
                except EngineDeadError:
                    pass

    def _prompt_ids(self, prompt: str | None, prompt_token_ids: list[int] | None) -> list[int]:
        if prompt_token_ids is None:
            if prompt is None or self.tokenizer is None:
                raise ValueError("give prompt_token_ids, or a text prompt for a model with a tokenizer")
            prompt_token_ids = self.tokenizer(prompt)["input_ids"]
        return [int(t) for t in prompt_token_ids]

    def _open(self, stream: RequestStream) -> None:
        self._streams[stream.request_id] = stream
        with self._outbox_lock:
            self._loops[stream.loop] = self._loops.get(stream.loop, 0) + 1

    def _close(self, stream: RequestStream) -> None:
        self._streams.pop(stream.request_id, None)
        with self._outbox_lock:
            left = self._loops[stream.loop] - 1
            if left:
                self._loops[stream.loop] = left
            else:
                del self._loops[stream.loop]

    async def abort(self, request_id: str) -> None:
        self._send(Abort(request_id))

    # ------------------------------------------------------------ the core's messages
    def _on_message(self, message: NamedTuple) -> None:
        """On the core's thread (in-process) or the reader thread: replies and adapter state here, the rest to the
        event loops whose streams it concerns."""
        kind = type(message)
        if kind is Reply:
            self._on_reply(message)
        elif kind is AdapterState:
            self._adapters = message
        else:
            self._to_loops(message)

    def _to_loops(self, message: NamedTuple) -> None:
        wake = []
        with self._outbox_lock:
            for loop in self._loops:
                box = self._outbox.get(loop)
                if box is None:
                    box = self._outbox[loop] = []
                    wake.append(loop)
                box.append(message)
        for loop in wake:
            try:
                loop.call_soon_threadsafe(self._drain, loop)
            except RuntimeError:  # the loop closed: nothing will read its streams
                with self._outbox_lock:
                    self._outbox.pop(loop, None)

    def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        """On `loop`: hand each message waiting for it to its streams there."""
        with self._outbox_lock:
            box = self._outbox.pop(loop, [])
        streams = self._streams
        for message in box:
            kind = type(message)
            if kind is StepOutputs:
                self._fan_out(message, loop)
            elif kind is Refused:
                stream = streams.get(message.request_id)
                if stream is not None and stream.loop is loop:
                    stream.fail(error_of(message.error))
            elif kind is Failed:
                for request_id in message.request_ids:
                    stream = streams.get(request_id)
                    if stream is not None and stream.loop is loop:
                        stream.fail(RuntimeError(f"engine failed while serving {request_id}: {message.message}"))
            elif kind is _Dead:
                for stream in list(streams.values()):
                    if stream.loop is loop:
                        stream.fail(message.error)

    def _fan_out(self, step: StepOutputs, loop: asyncio.AbstractEventLoop) -> None:
        """A step's outputs to their streams on `loop`: each stream's slice of the step's token ids."""
        streams, tokens, counts = self._streams, step.tokens, step.counts
        ended = dict(step.ended) if step.ended else None
        logprobs = {e[0]: e[1:] for e in step.logprobs} if step.logprobs else None
        logits = {e[0]: e[1:] for e in step.logits} if step.logits else None
        at = 0
        for i, request_id in enumerate(step.ids):
            n = counts[i]
            stream = streams.get(request_id)
            if stream is not None and stream.loop is loop:
                stream.feed(tokens[at:at + n], ended.get(i) if ended else None,
                            logprobs.get(i) if logprobs else None, _logits(logits.get(i)) if logits else None)
            at += n

    def _on_dead(self, reason: str) -> None:
        self._dead = EngineDeadError(reason)
        for future, _ in list(self._calls.values()):
            if not future.done():
                future.set_exception(self._dead)
        self._to_loops(_Dead(self._dead))
        for callback in self._dead_callbacks:
            callback(self._dead)

    def on_dead(self, callback: Callable[[EngineDeadError], None]) -> None:
        """Call `callback(error)` once the core is found dead (on the thread that found it)."""
        self._dead_callbacks.append(callback)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead

    # ------------------------------------------------------------ calls
    def _send(self, message: NamedTuple) -> None:
        self._check_alive()
        self._core.send(message)

    def _call(self, make: Callable[[int], NamedTuple], adapter_state: bool = False):
        """Send make(call id) and wait for its Reply; -> its value (adapter_state: the reply is the adapter state
        after the call, taken here before it returns)."""
        call, future = next(self._call_ids), Future()
        self._calls[call] = (future, adapter_state)
        try:
            self._send(make(call))
            self._check_alive()  # after registering: a death from now on fails the future
            return future.result()
        finally:
            self._calls.pop(call, None)

    def _on_reply(self, reply: Reply) -> None:
        future, adapter_state = self._calls.get(reply.call, (None, False))
        if future is None or future.done():
            return
        if reply.error is not None:
            future.set_exception(error_of(reply.error))
            return
        if adapter_state:
            self._adapters = AdapterState(*reply.value)
        future.set_result(reply.value)

    # ------------------------------------------------------------ adapters
    def add_adapter(self, name: str, path: str, pinned: bool = False) -> None:
        """Parse, validate and cache an adapter in the core (off its step loop); blocks until done. Raises
        AdapterError (a ValueError)."""
        self._call(lambda call: AddAdapter(call, name, path, pinned), adapter_state=True)

    def remove_adapter(self, name: str) -> None:
        self._call(lambda call: RemoveAdapter(call, name), adapter_state=True)

    def drop_cached_prefixes(self, name: str) -> None:
        """Queued for the core, which drops them between steps: the caller never waits for a step to end."""
        self._send(DropCachedPrefixes(name))

    def has_adapter(self, name: str) -> bool:
        return name in self._adapters.registered

    def pin_adapter(self, name: str, pinned: bool) -> None:
        self._send(PinAdapter(name, pinned))

    def host_adapters(self) -> list[str]:
        """The adapters parsed in the core's host memory, least recently used first, as the core last said."""
        return list(self._adapters.host_adapters)

    def rank_host_eviction(self, ranks: dict[str, list | tuple | None], replace: bool = False) -> None:
        """Update the order in which adapters leave the core's host cache (core/eviction_order.py): name -> rank,
        the smallest evicted first; None: never evicted; never ranked: before every ranked one. replace: forget
        the ranks set before."""
        self._send(RankHostEviction({name: None if r is None else list(r) for name, r in ranks.items()}, replace))

    # ------------------------------------------------------------ state
    def is_alive(self) -> bool:
        """The core runs (in a process: it has not exited; on a thread: its loop runs) and so does every
        tensor-parallel rank (a dead one fails every step: Serve replaces the replica on this answer)."""
        return self._dead is None and self._core.alive()

    def stats(self) -> dict:
        """The engine's stats (LLMEngine.stats), and the core loop's counters under "core"."""
        return self._call(GetStats)

    def set_speculation(self, spec: SpecConfig | None) -> None:
        """LLMEngine.set_speculation in the core, between steps; only while no request is in flight (ValueError)."""
        self._call(lambda call: SetSpeculation(call, None if spec is None else asdict(spec)))

    def start_profile(self, breakdown: bool = False) -> None:
        """Record the core's device activity from its next step (engine_ext.profiling.DeviceProfile, where the core
        runs); ValueError if a recording runs."""
        self._call(lambda call: Profile(call, "start", breakdown))

    def stop_profile(self) -> dict:
        """Stop the recording -> its summary: kernel_seconds (the union of the kernels' intervals), kernels,
        span_seconds, device ("cuda" or "cpu"), and with `breakdown` idle_gaps and top_kernels."""
        return self._call(lambda call: Profile(call, "stop", False))

    def shutdown(self, close_engine: bool = True) -> None:
        """Stop the core (`close_engine` False, in-process only: leave the engine usable, e.g. by another
        AsyncLLMEngine)."""
        self._core.close(close_engine)


def _logits(entry: list | None):
    if entry is None:
        return None
    import torch

    data, shape = entry
    return torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(shape)
