"""Adapter popularity: exponentially decayed request counts, and the tier they imply.

A router sees only its own traffic; that is enough to find the hot adapters, since the
ingress spreads requests evenly. The decay keeps the view current without a window buffer.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["PopularityTracker"]


@dataclass
class _Decayed:
    value: float = 0.0
    stamp: float = 0.0

    def at(self, now: float, half_life_s: float) -> float:
        return self.value * math.exp2(-(now - self.stamp) / half_life_s)

    def add(self, now: float, half_life_s: float, amount: float = 1.0) -> None:
        self.value = self.at(now, half_life_s) + amount
        self.stamp = now


@dataclass
class PopularityTracker:
    """Decayed per-adapter request counts with a half-life of `half_life_s` seconds."""

    half_life_s: float = 30.0
    clock: Callable[[], float] = time.monotonic
    max_entries: int = 10_000  # prune the coldest beyond this many adapters
    _counts: dict[str, _Decayed] = field(default_factory=dict)
    _total: _Decayed = field(default_factory=_Decayed)

    def __post_init__(self) -> None:
        if self.half_life_s <= 0:
            raise ValueError(f"half_life_s must be > 0, got {self.half_life_s}")

    def record(self, adapter: str) -> None:
        now = self.clock()
        self._counts.setdefault(adapter, _Decayed(stamp=now)).add(now, self.half_life_s)
        self._total.add(now, self.half_life_s)
        if len(self._counts) > self.max_entries:
            self._prune(now)

    def count(self, adapter: str) -> float:
        entry = self._counts.get(adapter)
        return 0.0 if entry is None else entry.at(self.clock(), self.half_life_s)

    def share(self, adapter: str) -> float:
        """This adapter's fraction of recent requests (0 when nothing was seen)."""
        total = self._total.at(self.clock(), self.half_life_s)
        return 0.0 if total <= 0 else self.count(adapter) / total

    def _prune(self, now: float) -> None:
        ranked = sorted(self._counts, key=lambda a: self._counts[a].at(now, self.half_life_s))
        for adapter in ranked[: len(ranked) - self.max_entries // 2]:
            del self._counts[adapter]
