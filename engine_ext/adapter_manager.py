"""Which adapters the engine knows, which are parsed in host memory (LRU, `max_cpu_loras`) and which
sit in device slots. Parsing from disk happens off the step loop, and each adapter is packed there once
into a (pinned) host buffer laid out like a slot; the step loop only issues the copy of that buffer,
which on a GPU runs beside the steps on a side stream, so a cold adapter does not stall other requests.

The host cache is the one record of which adapters are parsed in host memory: a serving layer asks it
(`host_resident`) rather than keeping a second list, and may order its evictions (`host_eviction`)."""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .adapter_slots import AdapterSlots, PackedAdapter, pack_adapter
from .lora_adapter import AdapterError, LoRAWeights, load_lora_adapter
from .model_config import ModelSpec
from .stats import EngineStats


class AdapterManager:
    def __init__(self, spec: ModelSpec, model_dir: str, max_loras: int, max_cpu_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, stats: EngineStats | None = None,
                 slots: AdapterSlots | None = None, pack: Callable[[LoRAWeights], PackedAdapter] | None = None,
                 slot_rank: int | None = None):
        """spec: the whole model (adapters are checked against it). slots, pack: the device slots and how a parsed
        adapter is packed for them (tensor parallelism: each rank's part, parallel/adapters.py); None: slots for
        the whole model, and an adapter packed as one of their rows, starting slot_rank wide (None: max_rank)."""
        self.spec, self.model_dir, self.max_rank = spec, model_dir, max_rank
        self.dtype, self.device = dtype, device
        self.max_cpu_loras = max_cpu_loras
        self.slots = slots or AdapterSlots(spec, max_loras, max_rank, dtype, device, rank=slot_rank)
        self.pack = pack or (lambda weights: pack_adapter(weights, spec, dtype, pin=self.device.type == "cuda"))
        self.paths: dict[str, str] = {}
        self.pinned: set[str] = set()
        self.stats = stats or EngineStats()  # loads and disk loads per adapter (the engine's stats object)
        self._host: OrderedDict[str, PackedAdapter] = OrderedDict()
        # Which host-resident adapter goes when the cache is over `max_cpu_loras`: called with the unpinned
        # candidates, least recently used first; None keeps them all for now. Default: least recently used.
        self.host_eviction: Callable[[list[str]], str | None] = lambda candidates: candidates[0]
        self._loading: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="adapter-load")
        self.removals = 0  # bumps on every remove(), so the engine knows when to look for orphans
        # name -> the registration its weights came from, unique over the engine's life: a name removed and added
        # again (new weights) gets a new one, which keys its prefix-cache blocks apart from the old ones'
        self.versions: dict[str, int] = {}
        self._registrations = itertools.count(1)

    # ------------------------------------------------------------ registration (any thread)
    def add(self, name: str, path: str, pinned: bool = False) -> PackedAdapter:
        if not name or not isinstance(name, str):
            raise AdapterError(str(name), "adapter name must be a non-empty string")
        if self.paths.get(name) == path:
            return self._host.get(name) or self._parse(name, path)  # idempotent re-add
        if name in self.paths or self.slots.slot_of(name) is not None:
            # A name maps to one set of weights for its whole life (device slots are keyed by name):
            # a new version needs a new name, or remove() and wait until the old one has left its slot.
            raise AdapterError(name, "an adapter of this name is already loaded; use a new name for new weights")
        packed = self._parse(name, path)
        with self._lock:
            self.paths[name] = path
            self.versions[name] = next(self._registrations)
            self.stats.adapter(name)
            if pinned:
                self.pinned.add(name)
            self._put_host(packed)
        return packed

    def remove(self, name: str) -> None:
        with self._lock:
            self.paths.pop(name, None)
            self.versions.pop(name, None)
            self.pinned.discard(name)
            self._host.pop(name, None)
            self.removals += 1

    def set_pinned(self, name: str, pinned: bool) -> None:
        """Pinned adapters are never evicted from host memory or from their device slot."""
        with self._lock:
            if pinned and name in self.paths:
                self.pinned.add(name)
            else:
                self.pinned.discard(name)

    def known(self, name: str) -> bool:
        return name in self.paths

    def _parse(self, name: str, path: str) -> PackedAdapter:
        start = time.perf_counter()
        weights = load_lora_adapter(name, path, self.spec, self.max_rank, self.model_dir)
        packed = self.pack(weights)
        with self._lock:
            stats = self.stats.adapter(name)
            stats.disk_loads += 1
            stats.disk_load_seconds += time.perf_counter() - start
        return packed

    def _put_host(self, packed: PackedAdapter) -> None:
        self._host[packed.name] = packed
        self._host.move_to_end(packed.name)
        while len(self._host) > self.max_cpu_loras:
            candidates = [n for n in self._host if n not in self.pinned and n != packed.name]
            victim = self.host_eviction(candidates) if candidates else None
            if victim is None:
                break
            del self._host[victim]

    # ------------------------------------------------------------ step loop
    def slot_of(self, name: str | None) -> int:
        return self.slots.lora_slot(name)

    def try_activate(self, name: str, busy: set[str]) -> bool:
        """Put `name` in a slot if possible now. False: not yet (slots busy, or parsing in background).
        True: it has a slot, but on a GPU its copy may still be in flight: see `ready`."""
        if self.slots.slot_of(name) is not None:
            self.slots.policy.touch(name)
            return True
        if not self.slots.can_activate(name, busy | self.pinned):
            return False
        with self._lock:
            packed = self._host.get(name)
            if packed is not None:
                self._host.move_to_end(name)
            elif name not in self._loading and name in self.paths:
                self._loading[name] = self._pool.submit(self._reload, name, self.paths[name])
        if packed is None:
            return False
        self.slots.activate(packed, busy | self.pinned)
        self.stats.adapter(name).loads += 1
        return True

    def ready(self, name: str) -> bool:
        """In a slot with its copy landed: sequences on it may run."""
        return self.slots.ready(name)

    def _reload(self, name: str, path: str) -> None:
        try:
            packed = self._parse(name, path)
            with self._lock:
                if name in self.paths:
                    self._put_host(packed)
        finally:
            with self._lock:
                self._loading.pop(name, None)

    def evict_unknown(self, busy: set[str]) -> bool:
        """Free the slots of removed adapters nothing running uses; True when none is left to free."""
        done = True
        for name in self.slots.resident:
            # busy, or its copy still in flight: free it on a later step
            if name not in self.paths and (name in busy or not self.slots.deactivate(name)):
                done = False
        return done

    @property
    def host_resident(self) -> list[str]:
        with self._lock:
            return list(self._host)

    @property
    def registered(self) -> list[str]:
        """Every adapter name added and not removed (parsed in host memory or not)."""
        with self._lock:
            return list(self.paths)
