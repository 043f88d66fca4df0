"""The engine core process: `python -m engine_ext.core.process`, started by its client (ProcessCore), which writes
one JSON line on stdin: {"config": EngineConfig fields, "input": address, "output": address, "engine_factory":
"module:function" or null, "torch_threads": n}. It builds the engine (its tensor-parallel ranks become its own
children), answers Ready (or StartFailed), and runs EngineCore until a Shutdown message; it exits at once when
stdin closes, its client being gone."""

from __future__ import annotations

import gc
import importlib
import json
import logging
import os
import sys
import threading
from typing import NamedTuple

import zmq

from ..config import EngineConfig
from ..llm_engine import LLMEngine
from .engine_core import EngineCore
from .messages import Ready, StartFailed, decode, encode, wire_error
from .process_core import batch_scheduled

logger = logging.getLogger(__name__)


class SocketInbox:
    def __init__(self, sock: zmq.Socket):
        self._sock = sock

    def take(self, timeout: float) -> list[NamedTuple]:
        if timeout > 0 and not self._sock.poll(timeout * 1000):
            return []
        out = []
        while True:
            try:
                out.append(decode(self._sock.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return out


class SocketOutbox:
    """Sends from any thread of the core (a zmq socket is not thread-safe)."""

    def __init__(self, sock: zmq.Socket):
        self._sock, self._lock = sock, threading.Lock()

    def send(self, message: NamedTuple) -> None:
        data = encode(message)
        with self._lock:
            self._sock.send(data)


def build_engine(config: EngineConfig, engine_factory: str | None) -> LLMEngine:
    """LLMEngine(config, detokenize=False), or what the function `engine_factory` ("module:function") builds
    from `config` (a benchmark's engine with its model's forward stubbed)."""
    if engine_factory is None:
        return LLMEngine(config, detokenize=False)
    module, _, name = engine_factory.partition(":")
    return getattr(importlib.import_module(module), name)(config)


def _exit_with_client() -> None:
    while os.read(0, 1 << 12):
        pass
    os._exit(0)  # the client is gone: nobody reads what this core would compute


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine-core %(name)s: %(message)s")
    start = json.loads(sys.stdin.readline())
    threading.Thread(target=_exit_with_client, name="client-watch", daemon=True).start()
    context = batch_scheduled(zmq.Context())
    inbox = context.socket(zmq.PULL)
    outbox = context.socket(zmq.PUSH)
    for sock, address in ((inbox, start["input"]), (outbox, start["output"])):
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.RCVHWM if sock is inbox else zmq.SNDHWM, 0)
        sock.connect(address)
    out = SocketOutbox(outbox)
    import torch

    torch.set_num_threads(start["torch_threads"])
    try:
        engine = build_engine(EngineConfig(**start["config"]), start["engine_factory"])
    except Exception as e:  # noqa: BLE001 - told to the client, typed (wire_error)
        logger.exception("the engine could not start")
        out.send(StartFailed(wire_error(e)))
        outbox.close()
        sys.exit(1)
    # This process serves one engine for its life: its start-up heap stays out of every later collection
    gc.collect()
    gc.freeze()
    out.send(Ready(engine.max_model_len, dict(engine.startup), engine.registered_adapters(), engine.host_adapters(),
                   os.getpid()))
    try:
        EngineCore(engine, SocketInbox(inbox), out.send).run()
    finally:
        engine.close()
        inbox.close()
        outbox.close()
        context.term()


if __name__ == "__main__":
    main()
