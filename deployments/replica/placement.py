"""One replica's side of the placement: its share of the plan, the request counts it evicts by,
and the keys it has pinned. Pure bookkeeping (no engine, no Ray); `LLMServer` acts on it."""

from __future__ import annotations

import time
from typing import Any, Callable

from router.keys import AdapterKey
from router.placement import TIER_COLD, TIER_NAMES, PlacementConfig, bump_count, eviction_key

__all__ = ["ReplicaPlacement"]


class ReplicaPlacement:
    def __init__(self, cfg: PlacementConfig, clock: Callable[[], float] = time.time):
        self.cfg, self._clock = cfg, clock
        self.share: dict[str, Any] = {"version": 0, "tiers": {}}  # from the controller: family -> tier name
        self.pinned: set[str] = set()  # adapter keys pinned in the engine
        self._usage: dict[str, tuple[float, float]] = {}  # key -> (decayed requests, last request)

    def tier(self, key: str) -> int:
        tier = self.share["tiers"].get(AdapterKey.family(key))
        return TIER_COLD if tier is None else TIER_NAMES.index(tier)

    def homes(self) -> list[str]:
        """Families homed here in host memory (pinned and warm)."""
        return sorted(f for f, t in self.share["tiers"].items() if t != TIER_NAMES[TIER_COLD])

    def wanted(self) -> list[tuple[str, int]]:
        """(family, tier) of the pinned and warm homes, pinned first: what to keep loaded."""
        tiers = [(f, TIER_NAMES.index(t)) for f, t in self.share["tiers"].items()]
        return sorted((ft for ft in tiers if ft[1] != TIER_COLD), key=lambda ft: (ft[1], ft[0]))

    def victim_key(self, key: str) -> tuple:
        """The engine's host cache evicts the smallest (ReplicaAdapters.choose_victim): homed elsewhere, then tier, then decayed requests."""
        count, stamp = self._usage.get(key, (0.0, 0.0))
        home = AdapterKey.family(key) in self.share["tiers"]
        return eviction_key(home, self.tier(key), count, stamp, self.cfg.half_life_s)

    def protected(self, key: str) -> bool:
        return self.tier(key) < TIER_COLD

    def note_request(self, key: str) -> None:
        now = self._clock()
        count, stamp = self._usage.get(key, (0.0, now))
        self._usage[key] = (bump_count(count, stamp, now, self.cfg.half_life_s), now)
