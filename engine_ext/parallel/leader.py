"""Rank 0 of a tensor-parallel engine: it starts the worker ranks (one spawned process each, rendezvous on a free
loopback port), and its runner and slots replay every forward, adapter load and freed slot on them, in order
(messages.py), before running their own part. The scheduler, block manager, sampling and the speculation gate
run here only; the workers execute the same forwards on their shards.

A rank that exits fails the engine within the collective or the send that meets it, and every later step fails at
once too, with RankFailure naming the rank and its exit code: a thread waits on the workers' exits and aborts rank
0's collectives in flight (gloo notices a closed peer by itself; an NCCL collective would wait for its timeout). A
rank alive but stuck fails it after `tp_timeout_s`."""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import wait

import torch
import torch.multiprocessing  # noqa: F401  (registers the reductions that send tensors through shared memory)

from ..config import EngineConfig
from ..model_config import ModelSpec
from ..model_runner import ModelRunner
from .comm import Collectives, free_port
from .layout import ShardLayout
from .messages import Launch, Stop, WarmUp
from .worker import WorkerArgs, run_worker

logger = logging.getLogger(__name__)
_EXIT_WAIT_S = 2.0  # how long a failure waits for a dying rank's exit code, to name it


class RankFailure(RuntimeError):
    """A tensor-parallel rank died or stopped answering: the engine cannot run another forward."""


class WorkerGroup:
    """The worker ranks 1 .. N-1 of one engine: their processes and the pipes rank 0 sends their messages on."""

    def __init__(self, config: EngineConfig, max_model_len: int, lookahead: int):
        ctx = mp.get_context("spawn")  # a fresh interpreter: no copy of this process's threads or CUDA state
        self.port = free_port()
        self.procs, self.conns = [], []
        # Rank 0 keeps its own threads; each worker takes its share of them, so N ranks on one CPU do not each
        # spin up a thread per core (oversubscribed, every collective waits on a descheduled rank)
        threads = max(1, torch.get_num_threads() // config.tensor_parallel_size)
        for rank in range(1, config.tensor_parallel_size):
            parent, child = ctx.Pipe()
            args = WorkerArgs(config, rank, self.port, max_model_len, lookahead, threads)
            proc = ctx.Process(target=run_worker, args=(args, child), name=f"tp-rank-{rank}", daemon=True)
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        self.failed: RankFailure | None = None
        self._closing = threading.Event()
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns, self._closing)

    def on_exit(self, abort: Callable[[], None]) -> None:
        """Call `abort` (from a watcher thread) as soon as a worker exits while the group is open."""
        threading.Thread(target=_watch_exits, args=(self.procs, self._closing, abort), name="tp-rank-watch",
                         daemon=True).start()

    def send(self, msg) -> None:
        """The same message to every worker."""
        self.send_each([msg] * len(self.conns))

    def send_each(self, msgs: list) -> None:
        """msgs[i] to rank i + 1."""
        self.check()
        with self.watch():
            for conn, msg in zip(self.conns, msgs):
                conn.send(msg)

    def check(self) -> None:
        """Raise RankFailure if a rank has failed or exited."""
        if self.failed is None and any(not p.is_alive() for p in self.procs):
            self.failed = self._failure("exited")
        if self.failed is not None:
            raise self.failed

    @contextmanager
    def watch(self) -> Iterator[None]:
        """Turn what a send or a forward raises into RankFailure (kept: every later call fails with it at once). Any
        error counts, not only a dead or stuck rank's: a forward that fails on rank 0 leaves the ranks out of step
        (the others may be waiting in a collective it never reached)."""
        try:
            yield
        except RankFailure:
            raise
        except Exception as e:
            self.failed = self._failure(f"failed ({type(e).__name__}: {e})")
            raise self.failed from e

    def _failure(self, what: str) -> RankFailure:
        deadline = time.monotonic() + _EXIT_WAIT_S
        while time.monotonic() < deadline and all(p.is_alive() for p in self.procs):
            time.sleep(0.02)
        dead = [f"rank {r} (pid {p.pid}, exit code {p.exitcode})" for r, p in enumerate(self.procs, 1)
                if not p.is_alive()]
        if dead:
            return RankFailure(f"tensor-parallel {', '.join(dead)} exited: the engine cannot run; restart it")
        return RankFailure(f"a tensor-parallel send or forward {what}; every worker rank is alive but the ranks are "
                           f"out of step: the engine cannot run; restart it")

    def close(self) -> None:
        self._finalizer()


def _watch_exits(procs: list, closing: threading.Event, abort: Callable[[], None]) -> None:
    wait([p.sentinel for p in procs])  # returns when one has exited
    if not closing.is_set():
        logger.error("tensor-parallel worker exited: %s", ", ".join(f"pid {p.pid} code {p.exitcode}" for p in procs))
        abort()


def _stop(procs: list, conns: list, closing: threading.Event) -> None:
    """Ask every live worker to leave, then end those that do not within a few seconds."""
    closing.set()
    for proc, conn in zip(procs, conns):
        try:
            if proc.is_alive():
                conn.send(Stop())
        except OSError:
            pass
        conn.close()
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)


class LeaderRunner(ModelRunner):
    """Rank 0's runner: each forward is sent to the workers first, then its device-side inputs are broadcast, then
    every rank runs it (the workers the same call, messages.Launch)."""

    relaunches = False  # each forward goes to the workers as its work (messages.Launch)

    def __init__(self, config: EngineConfig, spec: ModelSpec, device: torch.device, workers: WorkerGroup, *,
                 max_model_len: int, lookahead: int):
        self.workers = workers
        self.comm = Collectives(0, config.tensor_parallel_size, workers.port, device, config.tp_timeout_s)
        workers.on_exit(self.comm.abort)
        with workers.watch():
            super().__init__(config, spec, device, max_model_len=max_model_len, lookahead=lookahead,
                             layout=ShardLayout(spec, 0, config.tensor_parallel_size), comm=self.comm)

    def launch(self, work, slots, use_lora: bool = True, *, tokens: torch.Tensor | None = None,
               token_src: list[int] | None = None, shifts: torch.Tensor | None = None, owned: bool = True,
               started=None):
        self.workers.send(Launch(work, use_lora, token_src, _numel(tokens), _numel(shifts)))
        with self.workers.watch():
            for t in (tokens, shifts):
                if t is not None:
                    self.comm.broadcast(t)
            return super().launch(work, slots, use_lora, tokens=tokens, token_src=token_src, shifts=shifts,
                                  owned=owned, started=started)

    def warm_up(self, slots, blocks, max_num_batched_tokens: int) -> dict[str, float]:
        self.workers.send(WarmUp(max_num_batched_tokens))
        with self.workers.watch():
            return super().warm_up(slots, blocks, max_num_batched_tokens)


def _numel(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.numel()
