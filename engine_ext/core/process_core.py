"""An engine core in a process of its own (EngineConfig.engine_process), as its client sees it: the process, two
ZeroMQ sockets over IPC (the client's messages in, the core's out; msgpack, core/messages.py), and a reader thread
that hands each message of the core to the client and notices within READ_POLL_S when the process is gone.

The process reads its start-up settings as one JSON line on stdin and exits when stdin closes (the client's
process is gone), so a core never outlives its client."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import zmq

from ..config import EngineConfig
from ..errors import EngineDeadError
from .messages import Ready, Shutdown, StartFailed, decode, encode, error_of

__all__ = ["ProcessCore", "CoreLaunch", "CORE_MODULE", "config_fields"]

logger = logging.getLogger(__name__)
CORE_MODULE = "engine_ext.core.process"  # the core process's program: python -m CORE_MODULE
READ_POLL_S = 0.1  # the reader checks that the core's process runs whenever it waited this long for a message
CLOSE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class CoreLaunch:
    """How the core's process starts: `command` + ["-m", CORE_MODULE] under `env`. A launcher may run the program
    in a process of its own making (a fork of a server that imported it already) and stand for it: it exits as
    the core does, and its stdin is the core's."""

    command: tuple[str, ...] = ()  # empty: this interpreter
    env: dict | None = None  # None: this process's environment, its sys.path as PYTHONPATH (a benchmark's modules)

    def argv(self) -> list[str]:
        return [*(self.command or (sys.executable,)), "-m", CORE_MODULE]

    def environ(self) -> dict:
        if self.env is not None:
            return dict(self.env)
        return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))


def batch_scheduled(context: zmq.Context) -> zmq.Context:
    """`context` with its I/O threads scheduled as batch work where the system lets a thread take that policy
    (Linux): a thread that passes a message on, woken by every send, would otherwise preempt the step loop on its
    CPU (on the 2-core VM a send cost 130-250 us, 30-55 us with batch scheduling); it runs when the CPU's thread
    waits, or on another CPU. (ZeroMQ aborts the process when it cannot apply a policy: hence the probe.)"""
    if _can_batch_schedule():
        context.set(zmq.THREAD_SCHED_POLICY, os.SCHED_BATCH)
        context.set(zmq.THREAD_PRIORITY, 0)
    return context


def _batch_schedule_this_thread() -> bool:
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))  # pid 0: the calling thread only
    except (AttributeError, OSError):  # not Linux, or a sandbox that refuses it
        return False
    return True


def _can_batch_schedule() -> bool:
    """Whether a thread may take the batch policy, asked of a thread of its own (the policy dies with it)."""
    result = []
    probe = threading.Thread(target=lambda: result.append(_batch_schedule_this_thread()), name="sched-probe")
    probe.start()
    probe.join()
    return result[0]


def config_fields(config: EngineConfig) -> dict:
    """`config` as JSON-able data that EngineConfig(**fields) takes back."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    fields["kernels"] = dataclasses.asdict(config.kernels)
    fields["speculative"] = None if config.speculative is None else dataclasses.asdict(config.speculative)
    return fields


class ProcessCore:
    def __init__(self, config: EngineConfig, deliver: Callable[[NamedTuple], None], on_dead: Callable[[str], None],
                 engine_factory: str | None = None, launch: CoreLaunch = CoreLaunch()):
        """deliver: takes each message of the core, on the reader thread. on_dead(reason): the process exited
        without being asked to (called once, on the reader thread). Returns once the core is ready; raises what
        its engine raised when it could not start."""
        self._deliver, self._on_dead = deliver, on_dead
        self._dir = tempfile.mkdtemp(prefix="engine-core-")
        self._zmq = batch_scheduled(zmq.Context())
        self._input = self._bind(zmq.PUSH, "input")
        self._output = self._bind(zmq.PULL, "output")
        self._send_lock = threading.Lock()
        self._closing = False
        import torch

        start = {"config": config_fields(config), "input": self._address("input"), "output": self._address("output"),
                 "engine_factory": engine_factory, "torch_threads": torch.get_num_threads()}
        self._proc = subprocess.Popen(launch.argv(), stdin=subprocess.PIPE, env=launch.environ())
        try:
            self._proc.stdin.write((json.dumps(start) + "\n").encode())
            self._proc.stdin.flush()
            self.ready = self._wait_ready()
            self.pid = self.ready.pid  # the core's own (a launcher may have forked it)
        except BaseException:
            self._proc.kill()
            self._stop_process()
            self._close_sockets()
            raise
        self._reader = threading.Thread(target=self._read, name="engine-core-reader", daemon=True)
        self._reader.start()

    def _address(self, name: str) -> str:
        return f"ipc://{os.path.join(self._dir, name)}"

    def _bind(self, kind: int, name: str) -> zmq.Socket:
        sock = self._zmq.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM if kind == zmq.PUSH else zmq.RCVHWM, 0)  # never drop or block on a backlog
        sock.bind(self._address(name))
        return sock

    def _wait_ready(self) -> Ready:
        while not self._output.poll(READ_POLL_S * 1000):
            if self._proc.poll() is not None:
                raise EngineDeadError(f"the engine core exited with code {self._proc.returncode} before it was ready")
        message = decode(self._output.recv())
        if isinstance(message, StartFailed):
            raise error_of(message.error)
        if not isinstance(message, Ready):
            raise RuntimeError(f"the engine core's first message is a {type(message).__name__}, not Ready")
        return message

    # ------------------------------------------------------------ client -> core
    def send(self, message: NamedTuple) -> None:
        """Raises EngineDeadError when the core is gone (no peer on its socket)."""
        data = encode(message)
        with self._send_lock:
            try:
                self._input.send(data, zmq.NOBLOCK)
            except zmq.Again:  # no high-water mark: only a socket without its peer refuses
                raise EngineDeadError("the engine core is not connected") from None

    # ------------------------------------------------------------ core -> client
    def _read(self) -> None:
        _batch_schedule_this_thread()  # it hands messages on, as ZeroMQ's I/O threads do (see batch_scheduled)
        while not self._closing:
            if self._output.poll(READ_POLL_S * 1000):
                while True:
                    try:
                        data = self._output.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._deliver(decode(data))
            elif self._proc.poll() is not None:
                break
        if not self._closing:
            self._on_dead(f"the engine core (pid {self.pid}) exited (code {self._proc.returncode})")

    def alive(self) -> bool:
        return self._proc.poll() is None

    def close(self, close_engine: bool = True) -> None:
        """Stop the core (its engine closes with it)."""
        if not close_engine:
            raise ValueError("an engine core process closes its engine when it stops")
        self._closing = True
        if self._proc.poll() is None:
            try:
                self.send(Shutdown())
            except EngineDeadError:
                pass
        self._stop_process()
        self._reader.join(timeout=CLOSE_TIMEOUT_S)
        self._close_sockets()

    def _stop_process(self) -> None:
        try:
            self._proc.wait(timeout=CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("engine core %d did not stop within %.0f s: killing it", self._proc.pid, CLOSE_TIMEOUT_S)
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdin is not None:
            self._proc.stdin.close()

    def _close_sockets(self) -> None:
        self._input.close()
        self._output.close()
        self._zmq.term()
        shutil.rmtree(self._dir, ignore_errors=True)
