"""The adapter-affinity routing policy, as pure functions over replica snapshots.

For a request naming an adapter, `rank_replicas` orders the replicas; the Ray shell hands
them to Serve one per tier, and Serve takes the first with room. The order:

  1. replicas within the load bound (bounded-load hashing: in flight below max(floor,
     ceil(load_bound x mean)) and not saturated) before the others, so one hot adapter
     cannot pile onto a replica while others have room;
  2. replicas holding the adapter (device or host memory) before the others, and among those, the one that was
     sent the same prompt prefix (router.prefixes: adapter version and fingerprint) most recently first: its
     prefix cache likely still holds that prefix's KV, which saves a whole prompt computation;
  3. residency: the adapter on the device > in host memory > not there;
  4. its placement homes (from the placement controller; rendezvous homes without one);
  5. fewer requests in flight.

A cold adapter that already lives somewhere stays there (residency before home): a second
copy would cost a load and evict another adapter. Base-model requests use the power of two
choices.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from router.keys import AdapterKey
from router.rendezvous import home_replicas

__all__ = [
    "AffinityConfig",
    "ReplicaState",
    "num_homes",
    "is_saturated",
    "rank_for_adapter",
    "rank_for_base",
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
    load_bound: float = 1.6  # bounded load: skip a replica with more than this x the mean in flight
    load_bound_floor: int = 4  # ... unless it has fewer requests in flight than this
    prefix_affinity: bool = True  # among the adapter's holders, prefer the one last sent the same prompt prefix
    prefix_ttl_s: float = 60.0  # ... if that was at most this long ago (its cached KV is likely evicted later)

    def __post_init__(self) -> None:
        if self.cold_homes < 1 or self.hot_homes < self.cold_homes:
            raise ValueError("need 1 <= cold_homes <= hot_homes")
        if not 0.0 < self.hot_share <= 1.0:
            raise ValueError(f"hot_share must be in (0, 1], got {self.hot_share}")
        if not 0.0 < self.saturation <= 1.0:
            raise ValueError(f"saturation must be in (0, 1], got {self.saturation}")
        if self.load_bound < 1 or self.load_bound_floor < 1:
            raise ValueError("load_bound must be >= 1 and load_bound_floor >= 1")
        if (self.replication_factor <= 0 or self.popularity_half_life_s <= 0 or self.assignment_ttl_s <= 0
                or self.prefix_ttl_s <= 0):
            raise ValueError("replication_factor, popularity_half_life_s, assignment_ttl_s and prefix_ttl_s "
                             "must be > 0")


@dataclass(frozen=True)
class ReplicaState:
    """What the router knows about one replica when it routes a request."""

    replica_id: str
    queue_len: int  # requests in flight at the replica (router's cache, or its last report)
    max_ongoing: int
    device_adapters: frozenset[str] = frozenset()
    host_adapters: frozenset[str] = frozenset()
    free_kv_blocks: Optional[int] = None  # None: not reported yet
    homes: Optional[frozenset[str]] = None  # families the placement controller homed here; None: no plan

    def holds(self, adapter: str) -> bool:
        return adapter in self.device_adapters or adapter in self.host_adapters


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
    prefix_sent: Optional[Mapping[str, float]] = None,
) -> list[list[str]]:
    """Replica ids for a request for `adapter_key`, best first, one per tier (`rank_replicas`).

    `prefix_sent`: replica id -> when it was last sent this request's prompt prefix for this adapter version
    (router.prefixes.PrefixMemory.recency); used only with `cfg.prefix_affinity`.

    Homes: the replicas whose reported placement homes the adapter's family; when no replica
    reports a plan (no controller) or none homes it, its `homes` rendezvous homes. Replicas are
    shuffled first, so equal scores (say, two idle homes of a hot adapter) are broken at random.
    """
    rng = rng or random
    family = AdapterKey.family(adapter_key)
    planned = {r.replica_id for r in replicas if r.homes is not None and family in r.homes}
    home_ids = planned or set(home_replicas(family, [r.replica_id for r in replicas], homes))
    shuffled = list(replicas)
    rng.shuffle(shuffled)
    residency = [RESIDENT_DEVICE if adapter_key in r.device_adapters else
                 RESIDENT_HOST if adapter_key in r.host_adapters else RESIDENT_NONE for r in shuffled]
    sent = prefix_sent if cfg.prefix_affinity and prefix_sent else None
    order = rank_replicas(residency, [r.replica_id in home_ids for r in shuffled], [r.queue_len for r in shuffled],
                          cfg.load_bound, cfg.load_bound_floor, full=[is_saturated(r, cfg) for r in shuffled],
                          prefix_sent=None if sent is None else [sent.get(r.replica_id) for r in shuffled])
    return [[shuffled[i].replica_id] for i in order]


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
                  load_bound_floor: int = 2, full: Optional[Sequence[bool]] = None,
                  prefix_sent: Optional[Sequence[Optional[float]]] = None,
                  totals: Optional[tuple[float, int]] = None) -> list[int]:
    """Replica indices, best first, for one request for an adapter (the placement-aware score).

    residency[i] is `RESIDENT_DEVICE` > `RESIDENT_HOST` > `RESIDENT_NONE`; `is_home[i]` says
    whether the placement made replica i a home of the adapter; `loads[i]` is requests in
    flight. Bounded load: replica i is over the bound when loads[i] + 1 > max(load_bound_floor,
    ceil(load_bound * (sum(loads) + 1) / n)) or `full[i]`; those go last, so one hot adapter
    cannot push a replica past its share while others have room. Within each group: holders of
    the adapter first, among them the one sent the request's prompt prefix last (`prefix_sent[i]`:
    when, None: never or forgotten), then residency, then home, then load.

    `totals` = (requests in flight, replicas) of the whole cluster when the lists cover only some of its
    replicas (the simulator's candidates on a large cluster): the bound is the cluster's, not the subset's.
    """
    n = len(loads)
    if n == 0:
        return []
    in_flight, replicas = totals if totals is not None else (sum(loads), n)
    bound = max(load_bound_floor, math.ceil(load_bound * (in_flight + 1) / replicas))
    over = [loads[i] >= bound or (full is not None and full[i]) for i in range(n)]
    never = float("inf")
    recent = [never if prefix_sent is None or prefix_sent[i] is None or residency[i] == RESIDENT_NONE
              else -prefix_sent[i] for i in range(n)]
    return sorted(range(n), key=lambda i: (over[i], residency[i] == RESIDENT_NONE, recent[i], -residency[i],
                                           not is_home[i], loads[i]))
