"""The placement controller's state and loop body, without Ray: the single writer of placement.

Ingresses report how many requests each adapter family got since their last report; replicas
heartbeat. `plan()` decays the cluster-wide counts to now, tiers the adapters and picks their
homes with `router.placement` (the same functions `bench/placement_sim.py` runs), and returns
a `PlacementView`. A replica that stops heartbeating for `replica_ttl_s` is left out of the next
plan, so its pinned adapters get a new second home (replication restored). The Serve shell is
`deployments.placement.PlacementControllerDeployment`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

import numpy as np

from router.placement import (
    TIER_COLD, TIER_NAMES, PlacementConfig, assign_tiers, effective_rates, plan_homes,
    rendezvous_order,
)

__all__ = ["PlacementController", "PlacementView"]


@dataclass(frozen=True)
class PlacementView:
    """One plan, as JSON-able data: what `GET /admin/v1/placement` shows and replicas act on."""

    version: int
    replicas: tuple[str, ...]
    adapters: dict[str, dict]  # family -> {"tier": "pinned"|"warm"|"cold", "rate": req/s, "homes": [replica ids]}

    def to_json(self) -> dict:
        return {"version": self.version, "replicas": list(self.replicas), "adapters": self.adapters}

    @classmethod
    def from_json(cls, data: Mapping) -> "PlacementView":
        return cls(int(data["version"]), tuple(data["replicas"]), dict(data["adapters"]))

    def for_replica(self, replica_id: str) -> dict[str, str]:
        """family -> tier, for the pinned and warm adapters homed on `replica_id` (what it keeps loaded)."""
        return {name: a["tier"] for name, a in self.adapters.items()
                if a["tier"] != TIER_NAMES[TIER_COLD] and replica_id in a["homes"]}

    def tier(self, family: str) -> int:
        a = self.adapters.get(family)
        return TIER_COLD if a is None else TIER_NAMES.index(a["tier"])

    def homes(self, family: str) -> list[str]:
        a = self.adapters.get(family)
        return [] if a is None else list(a["homes"])


@dataclass
class PlacementController:
    cfg: PlacementConfig
    device_slots: int  # per replica (engine max_loras)
    host_slots: int  # per replica (engine max_cpu_loras)
    replica_ttl_s: float = 10.0
    clock: Callable[[], float] = time.monotonic
    _names: list[str] = field(default_factory=list)
    _index: dict[str, int] = field(default_factory=dict)
    _slow: np.ndarray = field(default_factory=lambda: np.zeros(0))
    _fast: np.ndarray = field(default_factory=lambda: np.zeros(0))
    _stamp: Optional[float] = None
    _seen: dict[str, float] = field(default_factory=dict)  # replica id -> last heartbeat
    _order_key: tuple = ()
    _order: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.int32))
    _tiers: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int8))
    _homes: dict[str, tuple[str, ...]] = field(default_factory=dict)  # family -> replica ids
    _view: Optional[PlacementView] = None

    # ------------------------------------------------------------ inputs
    def report(self, counts: Mapping[str, float]) -> None:
        """Requests per adapter family since the reporter's last report (any ingress or replica)."""
        self._decay_to(self.clock())
        for name, n in counts.items():
            i = self._slot(name)
            self._slow[i] += n
            self._fast[i] += n

    def heartbeat(self, replica_id: str) -> None:
        self._seen[replica_id] = self.clock()

    def forget_replica(self, replica_id: str) -> None:
        self._seen.pop(replica_id, None)

    # ------------------------------------------------------------ the plan
    def live_replicas(self) -> tuple[str, ...]:
        now = self.clock()
        return tuple(sorted(r for r, t in self._seen.items() if now - t <= self.replica_ttl_s))

    def plan(self) -> PlacementView:
        self._decay_to(self.clock())
        replicas = self.live_replicas()
        rates = effective_rates(self._slow, self._fast, self.cfg)
        n = len(replicas)
        prev_tiers = self._tiers if self._tiers.size == rates.size else None
        tiers = assign_tiers(rates, n, self.device_slots, self.host_slots, self.cfg, previous=prev_tiers)
        position = {r: i for i, r in enumerate(replicas)}
        previous = {self._index[f]: [position[r] for r in hs if r in position] for f, hs in self._homes.items()}
        homes = plan_homes(rates, tiers, self._rendezvous(replicas), self.device_slots, self.host_slots, self.cfg,
                           previous=previous) if n else {}
        self._tiers = tiers
        self._homes = {self._names[a]: tuple(replicas[r] for r in hs) for a, hs in homes.items()}
        version = (self._view.version + 1) if self._view else 1
        adapters = {
            name: {"tier": TIER_NAMES[int(tiers[i])], "rate": round(float(rates[i]), 6),
                   "homes": list(self._homes.get(name, ()))}
            for i, name in enumerate(self._names) if rates[i] > 0
        }
        self._view = PlacementView(version, replicas, adapters)
        return self._view

    @property
    def view(self) -> Optional[PlacementView]:
        return self._view

    # ------------------------------------------------------------ internals
    def _slot(self, name: str) -> int:
        i = self._index.get(name)
        if i is None:
            i = self._index[name] = len(self._names)
            self._names.append(name)
            self._slow = np.append(self._slow, 0.0)
            self._fast = np.append(self._fast, 0.0)
        return i

    def _decay_to(self, now: float) -> None:
        if self._stamp is not None and now > self._stamp:
            dt = now - self._stamp
            self._slow *= math.exp2(-dt / self.cfg.half_life_s)
            self._fast *= math.exp2(-dt / self.cfg.rising_half_life_s)
        self._stamp = now if self._stamp is None else max(self._stamp, now)

    def _rendezvous(self, replicas: tuple[str, ...]) -> np.ndarray:
        key = (replicas, len(self._names))
        if key != self._order_key:
            self._order = rendezvous_order(self._names, replicas)
            self._order_key = key
        return self._order
