"""The adapter-affinity routing policy, as pure functions over replica snapshots.

For a request naming an adapter, replicas are ranked in tiers; the Ray shell hands the
tiers to Serve, which takes the least-loaded replica of the first tier that has room.
Unsaturated replicas come first, in this order:

  cold adapter (1 home):  replicas holding it (device, then host memory) > its rendezvous
                          home > any other replica (spill, least loaded first)
  hot adapter (>= 2 homes): replicas holding it and its homes together (it spreads over
                          them on purpose) > any other replica

then the saturated ones: those holding it or homes (queue there rather than load it again),
then the rest. A cold adapter that already lives somewhere stays there: a second copy
would cost a load and, when adapter room is short, evict another adapter.

Base-model requests (no adapter) use the power of two choices.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Optional, Sequence

from router.rendezvous import home_replicas

__all__ = [
    "AffinityConfig",
    "ReplicaState",
    "num_homes",
    "is_saturated",
    "rank_for_adapter",
    "rank_for_base",
    "adapter_family",
    "rank_replicas",
    "RESIDENT_DEVICE",
    "RESIDENT_HOST",
    "RESIDENT_NONE",
]

RESIDENT_NONE, RESIDENT_HOST, RESIDENT_DEVICE = 0, 1, 2


@dataclass(frozen=True)
class AffinityConfig:
    """Knobs of the policy (passed as `request_router_kwargs`)."""

    cold_homes: int = 1  # home replicas of an adapter that is not hot
    hot_homes: int = 2  # minimum home replicas of a hot adapter
    hot_share: float = 0.1  # share of recent requests above which an adapter is hot
    min_hot_requests: float = 8.0  # ... and at least this many (decayed) requests
    replication_factor: float = 1.5  # hot: homes = ceil(share * replicas * factor)
    saturation: float = 0.75  # queue_len >= saturation * max_ongoing -> saturated, spill
    popularity_half_life_s: float = 30.0
    assignment_ttl_s: float = 30.0  # trust our own "sent adapter X to R" this long

    def __post_init__(self) -> None:
        if self.cold_homes < 1 or self.hot_homes < self.cold_homes:
            raise ValueError("need 1 <= cold_homes <= hot_homes")
        if not 0.0 < self.hot_share <= 1.0:
            raise ValueError(f"hot_share must be in (0, 1], got {self.hot_share}")
        if not 0.0 < self.saturation <= 1.0:
            raise ValueError(f"saturation must be in (0, 1], got {self.saturation}")
        if self.replication_factor <= 0 or self.popularity_half_life_s <= 0 or self.assignment_ttl_s <= 0:
            raise ValueError("replication_factor, popularity_half_life_s and assignment_ttl_s must be > 0")


@dataclass(frozen=True)
class ReplicaState:
    """What the router knows about one replica when it routes a request."""

    replica_id: str
    queue_len: int  # requests in flight at the replica (router's cache, or its last report)
    max_ongoing: int
    device_adapters: frozenset[str] = frozenset()
    host_adapters: frozenset[str] = frozenset()
    free_kv_blocks: Optional[int] = None  # None: not reported yet

    def holds(self, adapter: str) -> bool:
        return adapter in self.device_adapters or adapter in self.host_adapters


def adapter_family(adapter_key: str) -> str:
    """The part of `name@version` that homes hash on, so a promoted version keeps its homes."""
    return adapter_key.split("@", 1)[0]


def num_homes(share: float, count: float, num_replicas: int, cfg: AffinityConfig) -> int:
    """How many home replicas an adapter gets: 1 when cold, more as its share grows."""
    if num_replicas <= 0:
        return 0
    if count < cfg.min_hot_requests or share < cfg.hot_share:
        return min(cfg.cold_homes, num_replicas)
    wanted = math.ceil(share * num_replicas * cfg.replication_factor)
    return min(num_replicas, max(cfg.hot_homes, wanted))


def is_saturated(r: ReplicaState, cfg: AffinityConfig) -> bool:
    limit = max(1, math.floor(cfg.saturation * r.max_ongoing))
    return r.queue_len >= limit or r.free_kv_blocks == 0


def rank_for_adapter(
    adapter_key: str,
    replicas: Sequence[ReplicaState],
    homes: int,
    cfg: AffinityConfig,
    rng: Optional[random.Random] = None,
) -> list[list[str]]:
    """Tiers of replica ids for a request for `adapter_key` (see the module docstring).

    Within tier 0 a cold adapter prefers the replica already holding it; a hot one
    (homes > 1) breaks load ties at random so that it spreads over all its homes.
    """
    rng = rng or random
    home_ids = set(home_replicas(adapter_family(adapter_key), [r.replica_id for r in replicas], homes))
    spread = homes > 1
    free = [r for r in replicas if not is_saturated(r, cfg)]
    busy = [r for r in replicas if is_saturated(r, cfg)]

    def residency(r: ReplicaState) -> int:
        return 0 if adapter_key in r.device_adapters else 1 if adapter_key in r.host_adapters else 2

    def by_load(rs: list[ReplicaState]) -> list[ReplicaState]:
        return sorted(rs, key=lambda r: (r.queue_len, residency(r), r.replica_id))

    holders = [r for r in free if r.holds(adapter_key)]
    homes_free = [r for r in free if r.replica_id in home_ids and not r.holds(adapter_key)]
    others = [r for r in free if r not in holders and r not in homes_free]
    if spread:
        # load ties broken at random, so a hot adapter reaches every home even when idle
        first = sorted(holders + homes_free, key=lambda r: (r.queue_len, rng.random()))
        ordered = [first, by_load(others)]
    else:
        ordered = [sorted(holders, key=lambda r: (residency(r), r.queue_len, r.replica_id)), homes_free,
                   by_load(others)]
    preferred_busy = [r for r in busy if r.holds(adapter_key) or r.replica_id in home_ids]
    ordered += [by_load(preferred_busy), by_load([r for r in busy if r not in preferred_busy])]
    return [[r.replica_id for r in tier] for tier in ordered if tier]


def rank_for_base(replicas: Sequence[ReplicaState], rng: Optional[random.Random] = None) -> list[list[str]]:
    """Power of two choices: two random replicas, the less loaded first."""
    rng = rng or random
    if len(replicas) <= 2:
        picked = list(replicas)
        rng.shuffle(picked)
    else:
        picked = rng.sample(list(replicas), 2)
    picked.sort(key=lambda r: r.queue_len)
    return [[r.replica_id for r in picked]] if picked else []


def rank_replicas(residency: Sequence[int], is_home: Sequence[bool], loads: Sequence[int], load_bound: float,
                  load_bound_floor: int = 2, full: Optional[Sequence[bool]] = None) -> list[int]:
    """Replica indices, best first, for one request for an adapter (the placement-aware score).

    residency[i] is `RESIDENT_DEVICE` > `RESIDENT_HOST` > `RESIDENT_NONE`; `is_home[i]` says
    whether the placement made replica i a home of the adapter; `loads[i]` is requests in
    flight. Bounded load: replica i is over the bound when loads[i] + 1 > max(load_bound_floor,
    ceil(load_bound * (sum(loads) + 1) / n)) or `full[i]`; those go last, so one hot adapter
    cannot push a replica past its share while others have room. Within each group:
    residency, then home, then load.
    """
    n = len(loads)
    if n == 0:
        return []
    bound = max(load_bound_floor, math.ceil(load_bound * (sum(loads) + 1) / n))
    over = [loads[i] >= bound or (full is not None and full[i]) for i in range(n)]
    return sorted(range(n), key=lambda i: (over[i], -residency[i], not is_home[i], loads[i]))
