"""Adapter slots under tensor parallelism: every rank holds its part of each adapter (layout.py) in slots of its
own, and rank 0 decides which adapter goes in which slot; the other ranks replay each load and each freed slot in
order with the forwards, so the slot tables agree at every forward."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..adapter_slots import AdapterSlots, PackedAdapter, pack_adapter
from ..batch import SeqWork
from ..lora_adapter import LoRAWeights
from .layout import ShardLayout
from .messages import Clear, Place


@dataclass
class ShardedAdapter(PackedAdapter):
    """Rank 0's part of an adapter, packed like a slot row of its slots, and the other ranks' parts (rank 1 first),
    packed with it off the step loop (in the host cache, so a load only copies)."""

    others: tuple[PackedAdapter, ...] = ()


def pack_shards(weights: LoRAWeights, layouts: list[ShardLayout], dtype: torch.dtype, pin: bool) -> ShardedAdapter:
    """Each rank's part of a parsed adapter, packed at the adapter's rank; only rank 0's is pinned (the others go
    to their processes through shared memory, and pinned memory cannot be shared)."""
    own = pack_adapter(layouts[0].lora(weights), layouts[0].local, dtype, pin)
    others = tuple(pack_adapter(lay.lora(weights), lay.local, dtype, pin=False) for lay in layouts[1:])
    return ShardedAdapter(own.name, own.layout, own.data, own.scales, others)


class LeaderSlots(AdapterSlots):
    """Rank 0's slots: a load into a slot sends the other ranks their parts for the same slot, a freed slot frees
    theirs (`workers`: the WorkerGroup, whose messages run in the order they are sent)."""

    def __init__(self, spec, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device, workers):
        super().__init__(spec, max_loras, max_rank, dtype, device)
        self.workers = workers

    def activate(self, adapter: ShardedAdapter, busy: set[str]) -> int:
        placed = self.slot_of(adapter.name) is not None
        slot = super().activate(adapter, busy)
        if not placed:
            self.workers.send_each([Place(slot, part) for part in adapter.others])
        return slot

    def deactivate(self, name: str) -> bool:
        slot = self.slot_of(name)
        freed = super().deactivate(name)
        if freed and slot is not None:
            self.workers.send(Clear(slot))
        return freed


class MirrorSlots(AdapterSlots):
    """A worker rank's slots: the table is rank 0's, replayed (`place`, `clear`); nothing here chooses a slot.

    On a GPU a load's copy runs on the copy stream as on rank 0; nobody polls it here, so a forward that reads a
    slot first orders the compute stream after that slot's copy (`before_forward`)."""

    def place(self, slot: int, adapter: PackedAdapter) -> None:
        """Rank 0 put this adapter (this rank's part of it) into `slot`."""
        if adapter.rank > self.layout.rank:
            raise ValueError(f"adapter {adapter.name!r} (rank {adapter.rank}) does not fit these slots")
        self._forget(slot)
        self._copy_in(slot, adapter)
        self.table[slot] = adapter.name
        self.flush()

    def clear(self, slot: int) -> None:
        """Rank 0 freed `slot`: zeroed, after any copy into it."""
        self._after_copy(slot)
        self._forget(slot)
        self.slab[slot].zero_()
        self.scale_slab[slot].zero_()

    def before_forward(self, work: list[SeqWork]) -> None:
        """Order the compute stream after the copies into the slots this forward reads (none on a CPU: copies
        there are done when issued)."""
        for slot in {w.lora_slot for w in work} & set(self._loads):
            self._after_copy(slot)

    def _after_copy(self, slot: int) -> None:
        load = self._loads.pop(slot, None)
        if load is not None:
            if load.done is None:
                self._issue(slot, load)
            torch.cuda.current_stream(self.device).wait_event(load.done)
