"""The collectives a tensor-parallel forward runs, over one process group per engine.

One code path for both devices: a gloo group between CPU processes, an NCCL group between GPUs (the backend is
chosen by the device, nothing else differs). Each engine makes its own group over its own TCP store (not
torch.distributed's process-global default group), so engines in one process do not share or collide.

`Work.wait()` makes the caller wait for the collective: the host on gloo, the current CUDA stream (not the host)
on NCCL, so a GPU step still queues without waiting for the device."""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist


# How long the ranks may take to join (spawn, imports) and to load their shards, before their first collective: not
# `tp_timeout_s`, which bounds a collective once they run (a large shard's load may take minutes)
JOIN_TIMEOUT_S = 600.0


def free_port() -> int:
    """A free TCP port on the loopback interface (the rendezvous of one engine's ranks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SingleRank:
    """The collectives of a one-rank engine (ONE_RANK): nothing to exchange, every call returns its argument."""

    size = 1
    rank = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def min_int(self, n: int) -> int:
        return n


ONE_RANK = SingleRank()


class Collectives:
    """A process group of `size` ranks; every rank calls the same collectives in the same order."""

    def __init__(self, rank: int, size: int, port: int, device: torch.device, timeout_s: float):
        self.rank, self.size, self.device = rank, size, device
        timeout = datetime.timedelta(seconds=timeout_s)
        self.join_timeout = datetime.timedelta(seconds=max(timeout_s, JOIN_TIMEOUT_S))
        self.store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=self.join_timeout)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(self.store, rank, size, options)
        else:
            self.group = dist.ProcessGroupGloo(self.store, rank, size, timeout)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (the partial products of a row-parallel layer)."""
        self.group.allreduce([x]).wait()
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[N, C] on every rank -> [N, size * C]: rank r's columns at r * C (vocab-parallel logits)."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank, in place (device-side inputs of a forward: token ids, position shifts)."""
        self.group.broadcast(x, 0).wait()
        return x

    def abort(self) -> None:
        """End every collective in flight with an error, on this rank (a peer died: nothing will answer them)."""
        self.group.abort()

    def min_int(self, n: int) -> int:
        """The least of every rank's n (sizes that must agree, such as the KV blocks each rank's memory holds). The
        ranks' first collective, after loading their shards: it waits as long as joining may take."""
        t = torch.tensor([n], dtype=torch.long, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp, options.timeout = dist.ReduceOp.MIN, self.join_timeout
        self.group.allreduce([t], options).wait()
        return int(t.item())
