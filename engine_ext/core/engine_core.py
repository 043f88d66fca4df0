"""The engine core: the step loop of an engine whose client (AsyncLLMEngine) is elsewhere, on a thread of the
client's process or in a process of its own. It applies the client's messages between steps (new requests also
between a cycle's drafting passes), steps the engine while it has work, and sends one `StepOutputs` per step with
every output of that step: token ids, no text (the client detokenizes)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import NamedTuple, Protocol

from ..llm_engine import LLMEngine, StepContext
from ..config import SpecConfig
from ..output_processor import TokenDelta
from ..profiling import DeviceProfile
from ..sampling_params import SamplingParams
from .eviction_order import HostEvictionOrder
from .messages import (AddAdapter, AddRequest, AdapterState, Failed, Refused, RemoveAdapter, Reply, StepOutputs,
                       wire_error)

__all__ = ["EngineCore", "Inbox", "step_outputs"]

logger = logging.getLogger(__name__)
IDLE_WAIT_S = 0.5  # an idle core wakes this often without a message (to notice a dead rank)


class Inbox(Protocol):
    def take(self, timeout: float) -> list[NamedTuple]:
        """The messages sent since the last call, in order; waits up to `timeout` seconds for the first (0: none)."""


@dataclass
class CoreStats:
    steps: int = 0
    step_s: float = 0.0  # in LLMEngine.step
    publish_s: float = 0.0  # turning a step's outputs into a message and sending it


class EngineCore:
    def __init__(self, engine: LLMEngine, inbox: Inbox, send: Callable[[NamedTuple], None]):
        """send: hands a message to the client; any thread may call it (replies to AddAdapter come from the
        parsing thread)."""
        if engine.outputs.detokenizer is not None:
            raise ValueError("an engine core's engine leaves text to its client: build it with detokenize=False")
        self.engine, self._inbox, self._send = engine, inbox, send
        self.eviction = HostEvictionOrder()
        engine.set_host_eviction(self.eviction.choose)
        self._context = StepContext(arrivals=self._take_arrivals, publish=self._publish)
        self._later: list[NamedTuple] = []  # taken during a step, applied once it ends (all but new requests)
        self._adapters: AdapterState | None = None  # as last sent
        # Held while the adapter state is read and sent (alone, or as a reply to an adapter call), so the client
        # gets the states in the order they were read: the last one it takes is the newest
        self._state_lock = threading.Lock()
        self._parser = ThreadPoolExecutor(max_workers=1, thread_name_prefix="adapter-parse")
        self._stopped = False
        self.counters = CoreStats()
        self._profile = DeviceProfile()

    # ------------------------------------------------------------ the loop
    def run(self) -> None:
        """Until `stop()` (a Shutdown message) or a rank of the engine dies."""
        try:
            while not self._stopped:
                busy = self.engine.has_unfinished_requests
                later, self._later = self._later, []
                for message in later + self._inbox.take(0.0 if busy or later else IDLE_WAIT_S):
                    message.apply(self)
                self._send_adapter_state()
                if self._stopped or not self.engine.ranks.alive():
                    break
                if self.engine.has_unfinished_requests:
                    self._step()
        finally:
            self._parser.shutdown(wait=True)

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            outs = self.engine.step(self._context)
        except Exception as e:  # never die silently: fail the requests in flight, keep serving
            logger.exception("engine step failed")
            self._send(Failed(self.engine.abort_all(), f"{type(e).__name__}: {e}"))
            return
        self.counters.steps += 1
        self.counters.step_s += time.perf_counter() - start
        self._publish(outs)

    def _publish(self, outs: list[TokenDelta]) -> None:
        """A step's outputs (or a drafting pass's first tokens: StepContext.publish) as one message."""
        if outs:
            start = time.perf_counter()
            self._send(step_outputs(outs))
            self.counters.publish_s += time.perf_counter() - start

    def _take_arrivals(self) -> None:
        """Between a cycle's passes: add the requests sent since, keep the rest for the step's end."""
        for message in self._inbox.take(0.0):
            if isinstance(message, AddRequest):
                message.apply(self)
            else:
                self._later.append(message)

    def _adapter_state(self) -> AdapterState:
        return AdapterState(self.engine.registered_adapters(), self.engine.host_adapters())

    def _send_adapter_state(self) -> None:
        with self._state_lock:
            state = self._adapter_state()
            if state != self._adapters:
                self._adapters = state
                self._send(state)

    # ------------------------------------------------------------ what messages do
    def add_request(self, msg: AddRequest) -> None:
        try:
            self.engine.add_request(msg.request_id, None, msg.prompt_token_ids, SamplingParams(**msg.params),
                                    msg.adapter, msg.share_prompt_with)
        except Exception as e:  # noqa: BLE001 - a refusal, typed for the client (wire_error)
            self._send(Refused(msg.request_id, wire_error(e)))

    def add_adapter(self, msg: AddAdapter) -> None:
        """Parsed on a thread of its own (as an in-process engine parses on its caller's), so steps go on."""
        self._parser.submit(self._adapter_call, msg.call,
                            lambda: self.engine.add_adapter(msg.name, msg.path, msg.pinned))

    def remove_adapter(self, msg: RemoveAdapter) -> None:
        self._adapter_call(msg.call, lambda: self.engine.remove_adapter(msg.name))

    def _adapter_call(self, call: int, fn: Callable[[], None]) -> None:
        """Run `fn`; the reply is the adapter state after it, which the client takes before the call returns."""
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the caller's error, typed (wire_error)
            self._send(Reply(call, None, wire_error(e)))
            return
        with self._state_lock:
            self._adapters = self._adapter_state()
            self._send(Reply(call, list(self._adapters), None))

    def answer(self, call: int, fn: Callable[[], object]) -> None:
        try:
            value = fn()
        except Exception as e:  # noqa: BLE001 - the caller's error, typed (wire_error)
            self._send(Reply(call, None, wire_error(e)))
        else:
            self._send(Reply(call, value, None))

    def stats(self) -> dict:
        return self.engine.stats() | {"core": asdict(self.counters)}

    def set_speculation(self, spec: dict | None) -> None:
        """Between runs: requests in flight would change drafting mid-sequence (exact either way, but a benchmark's
        modes would mix), so it is refused while the engine has any."""
        if self.engine.has_unfinished_requests:
            raise ValueError("set_speculation while requests are in flight: wait for them to finish")
        self.engine.set_speculation(None if spec is None else SpecConfig(**spec))

    def profile(self, action: str, breakdown: bool = False) -> dict | None:
        if action == "start":
            self._profile.start(breakdown)
            return None
        if action == "stop":
            return self._profile.stop()
        raise ValueError(f"profile action must be 'start' or 'stop', not {action!r}")

    def stop(self) -> None:
        self._stopped = True


def step_outputs(outs: list[TokenDelta]) -> StepOutputs:
    ids, counts, tokens, ended, logprobs, logits = [], [], [], [], [], []
    for i, out in enumerate(outs):
        ids.append(out.request_id)
        counts.append(len(out.new_token_ids))
        tokens += out.new_token_ids
        if out.finish_reason is not None:
            ended.append([i, out.finish_reason])
        if out.new_logprobs:
            lps = out.new_logprobs
            logprobs.append([i, [lp.logprob for lp in lps], [[t for t, _ in lp.top] for lp in lps],
                             [[v for _, v in lp.top] for lp in lps]])
        if out.logits is not None:
            logits.append([i, out.logits.numpy().tobytes(), list(out.logits.shape)])
    return StepOutputs(ids, counts, tokens, ended, logprobs, logits)
