"""Popularity-tiered placement, as pure functions over arrays of per-adapter rates.

The placement controller (`router.controller`) and `bench/placement_sim.py` both call these;
nothing here knows about Ray or about time.

  tiers:  adapters ranked by decayed cluster-wide rate; the top `pinned_share` are pinned
          (on the device of >= `min_pinned_homes` replicas), the next `warm_share` warm (host
          memory of their homes), the rest cold (fetched on demand). The pinned and warm counts
          are capped by what the cluster's device and host slots can hold.
  homes:  each pinned or warm adapter gets k homes, k growing with its share of the load
          (ceil(share * replicas * replication_factor), at least 2 when pinned), picked along
          its rendezvous order with bounded loads: a replica takes an adapter only while its
          planned load stays under `load_bound` x the mean and it has slots left, so a hot
          adapter cannot pile onto one replica. Previous homes are tried first (no churn).
          Cold adapters with a rate get one home the same way (it takes no slot), so crossing a
          tier boundary does not move an adapter; never-seen ones use their rendezvous home.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import numpy as np

from router.rendezvous import rendezvous_score

__all__ = [
    "PlacementConfig",
    "TIER_PINNED",
    "TIER_WARM",
    "TIER_COLD",
    "TIER_NAMES",
    "assign_tiers",
    "plan_homes",
    "rendezvous_order",
    "wanted_homes",
    "eviction_key",
    "effective_rates",
    "bump_count",
]

TIER_PINNED, TIER_WARM, TIER_COLD = 0, 1, 2
TIER_NAMES = ("pinned", "warm", "cold")


@dataclass(frozen=True)
class PlacementConfig:
    """Knobs of tiering, replication and bounded-load routing (AppConfig `placement`)."""

    pinned_share: float = 0.10  # top share of active adapters (by rate) pinned on devices
    warm_share: float = 0.30  # next share kept in host memory on their homes; the rest is cold
    min_pinned_homes: int = 2
    replication_factor: float = 1.5  # homes = ceil(share_of_load * replicas * factor)
    pinned_device_fraction: float = 0.5  # device slots that pinned copies may take (rest: cache)
    pinned_copy_share: float = 0.1  # host slots that pinned adapters' extra copies may take
    home_host_fraction: float = 0.75  # host slots that planned homes may take (rest: cold cache)
    load_bound: float = 1.25  # planned homes: no replica above load_bound x the mean planned load
    route_load_bound: float = 1.6  # routing: a replica with more in flight than this x the mean is skipped
    load_bound_floor: int = 2  # ... unless it has fewer requests in flight than this
    half_life_s: float = 300.0  # decay of the rates that set tiers
    rising_half_life_s: float = 30.0  # a faster decay: an adapter rising on it is tiered early
    tier_hysteresis: float = 0.5  # an adapter leaves its tier only when 1.5x outranked
    home_stickiness: float = 0.1  # a previous home is kept up to this much over the load bound
    rising_min_requests: float = 4.0  # ... once it has this many (decayed) requests on that clock

    def __post_init__(self) -> None:
        if not (0 <= self.pinned_share <= 1 and 0 <= self.warm_share <= 1 and self.pinned_share + self.warm_share <= 1):
            raise ValueError("pinned_share and warm_share must be in [0, 1] and sum to <= 1")
        if self.min_pinned_homes < 1 or self.replication_factor <= 0:
            raise ValueError("min_pinned_homes must be >= 1 and replication_factor > 0")
        if not (0 <= self.pinned_device_fraction <= 1 and 0 <= self.home_host_fraction <= 1
                and 0 <= self.pinned_copy_share <= 1):
            raise ValueError("pinned_device_fraction, home_host_fraction and pinned_copy_share must be in [0, 1]")
        if self.load_bound < 1 or self.route_load_bound < 1 or self.load_bound_floor < 1:
            raise ValueError("load_bound and route_load_bound must be >= 1, load_bound_floor >= 1")
        if self.tier_hysteresis < 0 or self.home_stickiness < 0:
            raise ValueError("tier_hysteresis and home_stickiness must be >= 0")
        if self.half_life_s <= 0 or not 0 < self.rising_half_life_s <= self.half_life_s:
            raise ValueError("need 0 < rising_half_life_s <= half_life_s")


def effective_rates(slow: np.ndarray, fast: np.ndarray, cfg: PlacementConfig) -> np.ndarray:
    """Requests per second that tiers and homes go by, from decayed counts on two clocks.

    `slow`/`fast` are counts decayed with `half_life_s`/`rising_half_life_s`; a count c with
    half-life h is a rate of c * ln2 / h. An adapter whose fast rate is above its slow one
    (rising) and that has `rising_min_requests` on the fast clock is tiered on the fast rate,
    so it is warmed before it is hot; one request alone promotes nothing.
    """
    slow_rate = np.asarray(slow, dtype=np.float64) * (math.log(2) / cfg.half_life_s)
    fast = np.asarray(fast, dtype=np.float64)
    fast_rate = np.where(fast >= cfg.rising_min_requests, fast * (math.log(2) / cfg.rising_half_life_s), 0.0)
    return np.maximum(slow_rate, fast_rate)


def assign_tiers(rates: np.ndarray, num_replicas: int, device_slots: int, host_slots: int,
                 cfg: PlacementConfig, previous: Optional[np.ndarray] = None) -> np.ndarray:
    """-> tier per adapter (`TIER_*`, int8), by descending rate; adapters never seen are cold.

    With `previous` tiers, an adapter already in a tier ranks with its rate times
    (1 + tier_hysteresis) for that tier's cut, so rate noise at a boundary does not flip it
    (every flip of a pinned adapter would load or drop a second copy).
    """
    rates = np.asarray(rates, dtype=np.float64)
    tiers = np.full(rates.shape, TIER_COLD, dtype=np.int8)
    active = int(np.count_nonzero(rates > 0))
    if active == 0 or num_replicas <= 0:
        return tiers
    pin_room = num_replicas * math.floor(device_slots * cfg.pinned_device_fraction)
    # pinned copies fill 3/4 of their device room: the rest takes hot adapters' extra homes; and their
    # second copies take at most `pinned_copy_share` of all host slots (each one displaces an adapter)
    copies = max(1, min(cfg.min_pinned_homes, num_replicas))
    n_pin = min(math.ceil(cfg.pinned_share * active), (3 * pin_room // 4) // copies)
    if copies > 1:
        n_pin = min(n_pin, math.floor(cfg.pinned_copy_share * num_replicas * host_slots) // (copies - 1))
    host_room = num_replicas * math.floor(host_slots * cfg.home_host_fraction)
    n_warm = min(math.ceil(cfg.warm_share * active), max(0, host_room - n_pin * cfg.min_pinned_homes))
    n_warm = min(n_warm, active - n_pin)
    boost = 1.0 + cfg.tier_hysteresis
    prev = np.full(rates.shape, TIER_COLD, dtype=np.int8) if previous is None else np.asarray(previous)
    pin_score = np.where(prev == TIER_PINNED, rates * boost, rates)
    pinned = np.argsort(-pin_score, kind="stable")[:n_pin]
    tiers[pinned] = TIER_PINNED
    warm_score = np.where(prev <= TIER_WARM, rates * boost, rates)
    warm_score[pinned] = -1.0
    warm_score[rates <= 0] = -1.0
    tiers[np.argsort(-warm_score, kind="stable")[:n_warm]] = TIER_WARM
    tiers[pinned] = TIER_PINNED
    return tiers


def wanted_homes(share: float, tier: int, num_replicas: int, cfg: PlacementConfig) -> int:
    """Homes of an adapter with `share` of the cluster's load: more as the share grows."""
    floor = cfg.min_pinned_homes if tier == TIER_PINNED else 1
    k = max(floor, math.ceil(share * num_replicas * cfg.replication_factor))
    return min(k, num_replicas)


def rendezvous_order(keys: Sequence[str], replicas: Sequence[str]) -> np.ndarray:
    """[len(keys), len(replicas)] replica indices, each row best first (`router.rendezvous`'s weights)."""
    scores = np.array([[rendezvous_score(k, r) for r in replicas] for k in keys], dtype=np.uint64)
    if scores.size == 0:
        return np.zeros((len(keys), len(replicas)), dtype=np.int32)
    return np.argsort(-scores.astype(np.float64), axis=1, kind="stable").astype(np.int32)


def plan_homes(rates: np.ndarray, tiers: np.ndarray, order: np.ndarray, device_slots: int, host_slots: int,
               cfg: PlacementConfig, previous: Optional[Mapping[int, Sequence[int]]] = None,
               alive: Optional[Sequence[bool]] = None) -> dict[int, tuple[int, ...]]:
    """-> {adapter index: home replica indices, best first} for every adapter with a rate > 0.

    Pinned and warm adapters take host slots (pinned ones device slots too) on homes picked
    under the load bound; a cold one keeps its previous home (else its rendezvous home) and
    takes no slot, so an adapter does not move when it crosses a tier boundary. `order` is `rendezvous_order` (rows per
    adapter); `previous` the last plan (tried first); `alive[r]` False leaves replica r out.
    """
    rates = np.asarray(rates, dtype=np.float64)
    n = order.shape[1]
    up = np.ones(n, dtype=bool) if alive is None else np.asarray(alive, dtype=bool)
    live = int(up.sum())
    total = float(rates.sum())
    if live == 0 or total <= 0:
        return {}
    previous = previous or {}
    load = np.where(up, 0.0, np.inf).tolist()
    homes: dict[int, tuple[int, ...]] = {}
    rates_l, tiers_l = rates.tolist(), tiers.tolist()
    # cold: the previous home, else the first live one in rendezvous order; no bound (each is small)
    for a in np.flatnonzero((rates > 0) & (tiers == TIER_COLD)).tolist():
        prev = [r for r in previous.get(a, ()) if r < n and up[r]]
        r = prev[0] if prev else next(r for r in order[a].tolist() if up[r])
        homes[a] = (r,)
        load[r] += rates_l[a]
    placed = np.flatnonzero((rates > 0) & (tiers <= TIER_WARM))
    placed = placed[np.lexsort((tiers[placed], -rates[placed]))].tolist()
    cap = cfg.load_bound * total / live
    pin_room = [math.floor(device_slots * cfg.pinned_device_fraction) if u else 0 for u in up]
    host_room = [math.floor(host_slots * cfg.home_host_fraction) if u else 0 for u in up]
    for a in placed:
        tier = tiers_l[a]
        k = min(wanted_homes(rates_l[a] / total, tier, live, cfg), live)
        per = rates_l[a] / k
        room = host_room if tier == TIER_WARM else [min(h, p) for h, p in zip(host_room, pin_room)]
        chosen: list[int] = []
        prev = [r for r in previous.get(a, ()) if r < n]
        for r in prev + order[a].tolist():
            limit = cap * (1.0 + cfg.home_stickiness) if r in prev else cap
            if r not in chosen and room[r] > 0 and load[r] + per <= limit:
                chosen.append(r)
                if len(chosen) == k:
                    break
        if len(chosen) < k:  # nothing under the bound: the least loaded replicas with room
            for r in sorted(range(n), key=load.__getitem__):
                if r not in chosen and room[r] > 0 and up[r]:
                    chosen.append(r)
                    if len(chosen) == k:
                        break
        for r in chosen:
            load[r] += per
            host_room[r] -= 1
            if tier == TIER_PINNED:
                pin_room[r] -= 1
        if chosen:
            homes[a] = tuple(chosen)
    return homes


def eviction_key(home: bool, tier: int, count: float, stamp: float, half_life_s: float) -> tuple[bool, int, float]:
    """Replicas evict the adapter with the smallest key: copies of adapters homed elsewhere
    first (left by a spill or a move; the router sends their traffic to the homes), then cold
    before warm before pinned, then the one with the fewest requests on the replica, decayed
    with `half_life_s` (popularity, with recency only as the decay).

    `count` is the adapter's decayed request count as of `stamp` (its last request). Since
    count * 2^(-(t - stamp)/h) orders entries the same at every t as log2(count) + stamp/h,
    the key never changes between requests and can sit in a heap.
    """
    return (home, TIER_COLD - tier, math.log2(max(count, 1e-12)) + stamp / half_life_s)


def bump_count(count: float, stamp: float, now: float, half_life_s: float) -> float:
    """A decayed count after one more request at `now`."""
    return count * math.exp2(-(now - stamp) / half_life_s) + 1.0
