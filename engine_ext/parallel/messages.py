"""What rank 0 sends each worker rank, in order: every message is one call the worker makes on its own shard, the
same call rank 0 makes on its own (`apply`). Sent through a pipe per worker (pickled; tensors go through shared
memory), never through a collective, so a worker idle between requests waits on its pipe, not on a timeout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..adapter_slots import PackedAdapter
from ..batch import SeqWork


class Rank(Protocol):
    """What a message acts on: a worker rank's runner, slots and collectives (worker.WorkerRank)."""

    runner: object
    slots: object
    comm: object


@dataclass
class Launch:
    """One forward (ModelRunner.launch's arguments). The device-side inputs, rank 0's token buffer and position
    shifts, are not in the message: every rank receives them by broadcast just before the forward (`lengths`)."""

    work: list[SeqWork]
    use_lora: bool
    token_src: list[int] | None
    tokens_len: int | None  # numel of rank 0's `tokens` (None: none)
    shifts_len: int | None

    def apply(self, rank: Rank) -> None:
        tokens = _received(rank, self.tokens_len)
        shifts = _received(rank, self.shifts_len)
        rank.slots.before_forward(self.work)
        rank.runner.launch(self.work, rank.slots, self.use_lora, tokens=tokens, token_src=self.token_src,
                           shifts=shifts, owned=False)


def _received(rank: Rank, numel: int | None) -> torch.Tensor | None:
    if numel is None:
        return None
    return rank.comm.broadcast(torch.empty(numel, dtype=torch.long, device=rank.runner.device))


@dataclass
class Place:
    """Rank 0 loaded an adapter into `slot`: this rank's part of it."""

    slot: int
    adapter: PackedAdapter

    def apply(self, rank: Rank) -> None:
        rank.slots.place(self.slot, self.adapter)


@dataclass
class Clear:
    """Rank 0 freed `slot`."""

    slot: int

    def apply(self, rank: Rank) -> None:
        rank.slots.clear(self.slot)


@dataclass
class WarmUp:
    """ModelRunner.warm_up, against a block manager as fresh as rank 0's (the same allocations, so the same
    forwards)."""

    max_num_batched_tokens: int

    def apply(self, rank: Rank) -> None:
        from ..block_manager import BlockManager

        blocks = BlockManager(rank.runner.num_blocks, rank.runner.config.block_size)
        rank.runner.warm_up(rank.slots, blocks, self.max_num_batched_tokens)


@dataclass
class Stop:
    """The engine is closing: the worker leaves its loop."""
