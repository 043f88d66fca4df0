"""Adapter slots on the device: an explicit slot table plus the stacked A/B/scale tensors the batched
LoRA op reads. The last slot is all zeros and serves base-only tokens. Eviction is a separate policy."""

from __future__ import annotations

from collections import OrderedDict

import torch

from .constants import LORA_MODULES
from .lora_adapter import LoRAWeights
from .model_config import ModelSpec


class LRUPolicy:
    """Least recently used first; `victim` picks among the candidates it is offered."""

    def __init__(self) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()

    def touch(self, name: str) -> None:
        self._order.pop(name, None)
        self._order[name] = None

    def forget(self, name: str) -> None:
        self._order.pop(name, None)

    def victim(self, candidates: set[str]) -> str | None:
        return next((n for n in self._order if n in candidates), None)


class AdapterSlots:
    def __init__(self, spec: ModelSpec, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device,
                 policy: LRUPolicy | None = None):
        self.max_loras = max_loras
        self.zero_slot = max_loras
        num_slots, layers = max_loras + 1, spec.num_layers
        e = dict(dtype=dtype, device=device)
        shapes = spec.module_shapes()
        self.a = {m: torch.zeros(layers, num_slots, shapes[m][0], max_rank, **e) for m in LORA_MODULES}
        self.b = {m: torch.zeros(layers, num_slots, max_rank, shapes[m][1], **e) for m in LORA_MODULES}
        self.scale = {m: torch.zeros(layers, num_slots, dtype=torch.float32, device=device) for m in LORA_MODULES}
        self.table: list[str | None] = [None] * max_loras  # slot -> adapter name
        self.policy = policy or LRUPolicy()

    def slot_of(self, name: str) -> int | None:
        try:
            return self.table.index(name)
        except ValueError:
            return None

    @property
    def resident(self) -> list[str]:
        return [n for n in self.table if n is not None]

    def _free_or_victim(self, busy: set[str]) -> int | None:
        if None in self.table:
            return self.table.index(None)
        victim = self.policy.victim({n for n in self.table if n not in busy})
        return None if victim is None else self.table.index(victim)

    def can_activate(self, name: str, busy: set[str]) -> bool:
        """`busy`: adapters that must stay (in use by running sequences, or pinned)."""
        return self.slot_of(name) is not None or self._free_or_victim(busy) is not None

    def activate(self, weights: LoRAWeights, busy: set[str]) -> int:
        """Copy an adapter into a slot (evicting the policy's victim if all are taken); returns the slot."""
        slot = self.slot_of(weights.name)
        if slot is None:
            slot = self._free_or_victim(busy)
            if slot is None:
                raise RuntimeError("no adapter slot is free or evictable")
            self.evict_slot(slot)
            for (layer, module), a in weights.a.items():
                r = a.shape[1]
                self.a[module][layer, slot, :, :r].copy_(a, non_blocking=True)
                self.b[module][layer, slot, :r, :].copy_(weights.b[(layer, module)], non_blocking=True)
                self.scale[module][layer, slot] = weights.scale[(layer, module)]
            self.table[slot] = weights.name
        self.policy.touch(weights.name)
        return slot

    def evict_slot(self, slot: int) -> None:
        name = self.table[slot]
        if name is None:
            return
        for m in LORA_MODULES:
            self.a[m][:, slot].zero_()
            self.b[m][:, slot].zero_()
            self.scale[m][:, slot] = 0.0
        self.table[slot] = None
        self.policy.forget(name)

    def deactivate(self, name: str) -> None:
        slot = self.slot_of(name)
        if slot is not None:
            self.evict_slot(slot)
