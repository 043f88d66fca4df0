"""An engine core on a thread of its client's process (EngineConfig.engine_process False): messages pass as
objects through a queue, none encoded. Tests and notebooks use it; it shares the client's interpreter (and GIL)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import NamedTuple

from ..llm_engine import LLMEngine
from .engine_core import EngineCore
from .messages import Ready, Shutdown

__all__ = ["ThreadCore"]


class QueueInbox:
    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, message: NamedTuple) -> None:
        self._queue.put(message)

    def take(self, timeout: float) -> list[NamedTuple]:
        out = []
        if timeout > 0:
            try:
                out.append(self._queue.get(timeout=timeout))
            except queue.Empty:
                return out
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out


class ThreadCore:
    def __init__(self, engine: LLMEngine, deliver: Callable[[NamedTuple], None], on_dead: Callable[[str], None]):
        """deliver: takes each message of the core, on the core's thread. on_dead(reason): the loop ended without
        being asked to (a tensor-parallel rank died)."""
        self.engine, self._on_dead = engine, on_dead
        self._closing = False
        self._inbox = QueueInbox()
        self.core = EngineCore(engine, self._inbox, deliver)
        self.ready = Ready(engine.max_model_len, dict(engine.startup), engine.registered_adapters(),
                           engine.host_adapters(), None)
        self.pid = None  # the core runs in this process
        self._thread = threading.Thread(target=self._run, name="engine-core", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.core.run()
        finally:
            if not self._closing:
                self._on_dead("the engine core's loop ended: a tensor-parallel rank is gone")

    def send(self, message: NamedTuple) -> None:
        self._inbox.put(message)

    def alive(self) -> bool:
        """The loop runs (it outlives a failed step) and so does every tensor-parallel rank."""
        return self._thread.is_alive() and self.engine.ranks.alive()

    def close(self, close_engine: bool = True) -> None:
        self._closing = True
        self.send(Shutdown())
        self._thread.join(timeout=5)
        if close_engine:
            self.engine.close()
