"""Trace simulator of adapter placement: our tiered placement against three baselines.

    python bench/placement_sim.py --adapters 10000 --replicas 8 --device-slots 64 --host-slots 1024 \\
        --concurrency 200 --popularity zipf:1.0 --requests 300000 --warmup 100000 --seed 1

`ours` runs the same code as the placement controller and the router: `router.placement`
(tiers, homes with bounded loads, eviction order) and `router.policy.rank_replicas`. Baselines
on the same trace: per-replica LRU + least-loaded routing, Ray Serve's default multiplexed
routing (replicas holding the adapter first, power of two choices among them, else among all)
and LRU + consistent (rendezvous) hashing. `static_bound` is the share of requests whose adapter
is among the K most popular, K = replicas x host slots (the best static placement's hit rate).

Model: Gamma arrivals (`--cv`) at the rate that keeps `--concurrency` requests in flight
(Little's law with `--service-s`); each replica serves ceil(1.25 x concurrency / replicas)
requests at once, FCFS. A request whose adapter is not in the serving replica's host memory
fetches it (`--fetch-s`, delaying that request only); host -> device takes `--h2d-s`.
`requests` counts all requests; the figures are over the ones after `--warmup`.
`device`/`host`/`fetch`: where the adapter was when the request arrived (a request arriving
while its adapter is still loading counts as fetch); `fetches_per_1k` counts every blob-store
fetch, prefetches included. One line per policy adds queueing p99 (arrival -> start of decoding),
prefetches per 1,000 and the share served off its home (ours only); the last line printed is one
JSON object with the keys issue 17 names.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from router.placement import (  # noqa: E402
    TIER_COLD, TIER_PINNED, TIER_WARM, PlacementConfig, assign_tiers, bump_count, effective_rates, eviction_key, plan_homes, rendezvous_order,
)
from router.policy import RESIDENT_DEVICE, RESIDENT_HOST, RESIDENT_NONE, rank_replicas  # noqa: E402

BASELINES = ("lru_least_loaded", "ray_default", "lru_consistent_hash")


@dataclass
class Trace:
    arrivals: np.ndarray  # [R] seconds
    adapters: np.ndarray  # [R] adapter index
    service: np.ndarray  # [R] seconds of decoding
    probs: np.ndarray  # [A] true popularity


def make_trace(args) -> Trace:
    rng = np.random.default_rng(args.seed)
    kind, _, param = args.popularity.partition(":")
    a, n = args.adapters, args.requests
    if kind == "zipf":
        w = 1.0 / np.arange(1, a + 1, dtype=np.float64) ** float(param)
        probs = w / w.sum()
        ranks = rng.choice(a, size=n, p=probs)
    elif kind == "powerlaw":  # S-LoRA: index = floor(power(alpha) * adapters)
        alpha = float(param)
        ranks = np.minimum((rng.power(alpha, n) * a).astype(np.int64), a - 1)
        edges = (np.arange(a + 1) / a) ** alpha
        probs = np.diff(edges)
    else:
        raise SystemExit(f"--popularity must be zipf:S or powerlaw:ALPHA, got {args.popularity}")
    perm = rng.permutation(a)  # popularity rank -> adapter id, so ids say nothing about rank
    rate = args.concurrency / args.service_s
    shape = 1.0 / args.cv ** 2
    gaps = rng.gamma(shape, 1.0 / (rate * shape), n)
    service = rng.gamma(2.0, args.service_s / 2.0, n)
    true = np.empty(a)
    true[perm] = probs
    return Trace(np.cumsum(gaps), perm[ranks], service, true)


class Cluster:
    """Per-replica queues (FCFS, `slots` at once) and in-flight counts, shared by all policies."""

    def __init__(self, n: int, slots: int):
        self.free = [[0.0] * slots for _ in range(n)]  # heaps of slot-free times
        self.ends = [[] for _ in range(n)]  # heaps of end times of requests in flight
        self.loads = [0] * n
        self.total = 0

    def advance(self, t: float) -> None:
        for r, ends in enumerate(self.ends):
            while ends and ends[0] <= t:
                heapq.heappop(ends)
                self.loads[r] -= 1
                self.total -= 1

    def run(self, r: int, t: float, ready: float, service: float) -> float:
        """Queue a request at replica r; -> its queueing delay (arrival -> start of decoding)."""
        slot = heapq.heappop(self.free[r])
        start = max(ready, slot)
        end = start + service
        heapq.heappush(self.free[r], end)
        heapq.heappush(self.ends[r], end)
        self.loads[r] += 1
        self.total += 1
        return start - t


class LRUReplica:
    """Host memory and device slots, both least recently used."""

    def __init__(self, host: int, device: int):
        self.host: OrderedDict[int, float] = OrderedDict()  # adapter -> ready time
        self.device: OrderedDict[int, None] = OrderedDict()
        self.hcap, self.dcap = host, device

    def serve(self, a: int, t: float, fetch_s: float, h2d_s: float) -> tuple[int, float, int]:
        """-> (residency at arrival, ready time, fetches issued)."""
        ready = self.host.get(a)
        if ready is None:
            self.host[a] = ready = t + fetch_s
            if len(self.host) > self.hcap:
                old, _ = self.host.popitem(last=False)
                self.device.pop(old, None)
            self._to_device(a)
            return RESIDENT_NONE, ready, 1
        self.host.move_to_end(a)
        if ready > t:
            return RESIDENT_NONE, ready, 0
        if a in self.device:
            self.device.move_to_end(a)
            return RESIDENT_DEVICE, t, 0
        self._to_device(a)
        return RESIDENT_HOST, t + h2d_s, 0

    def _to_device(self, a: int) -> None:
        self.device[a] = None
        if len(self.device) > self.dcap:
            self.device.popitem(last=False)


class TieredReplica:
    """Our replica: planned homes are protected (pinned ones on the device), the rest of host
    memory evicts by `router.placement.eviction_key` (tier, then decayed request count)."""

    def __init__(self, index: int, host: int, device: int, half_life_s: float, top1: list[int]):
        self.index, self.top1 = index, top1
        self.homed: dict[int, tuple[int, ...]] = {}  # the plan's homes of every adapter
        self.host: dict[int, float] = {}  # adapter -> ready time
        self.last: dict[int, float] = {}  # adapter -> last use (validates heap entries)
        self.count: dict[int, float] = {}  # adapter -> decayed requests here, as of `last`
        self.hl = half_life_s
        self.heap: list = []  # (eviction key, adapter), lazily invalidated
        self.device: OrderedDict[int, None] = OrderedDict()  # unpinned device slots, LRU
        self.pinned: set[int] = set()
        self.homes: set[int] = set()
        self.hcap, self.dcap = host, device

    def replan(self, homes: set[int], pinned: set[int], homed: dict, tiers, t: float, fetch_s: float) -> int:
        """Adopt a new plan: prefetch new homes (pinned ones onto the device); -> fetches."""
        fetches = 0
        self.homes, self.pinned, self.homed = homes, pinned, homed
        for a in homes:
            if a not in self.host:
                self.host[a] = t + fetch_s
                self.last[a], self.count[a] = t, 0.0
                fetches += 1
        for a in pinned:
            self.device.pop(a, None)
        self.heap = [(self._key(tiers[a], a), self.last[a], a) for a in self.host if a not in homes]
        heapq.heapify(self.heap)
        self._evict_host()
        while len(self.device) > max(0, self.dcap - len(self.pinned)):
            self.device.popitem(last=False)
        return fetches

    def _key(self, tier: int, a: int) -> tuple:
        home = self.index in self.homed.get(a, (self.top1[a],))
        return eviction_key(home, tier, self.count[a], self.last[a], self.hl)

    def serve(self, a: int, t: float, fetch_s: float, h2d_s: float, tiers) -> tuple[int, float, int]:
        ready = self.host.get(a)
        self.count[a] = bump_count(self.count.get(a, 0.0), self.last.get(a, t), t, self.hl) if ready is not None else 1.0
        self.last[a] = t
        if a not in self.homes:
            heapq.heappush(self.heap, (self._key(tiers[a], a), t, a))
        if ready is None:
            self.host[a] = ready = t + fetch_s
            self._evict_host(keep=a)
            self._to_device(a)
            return RESIDENT_NONE, ready, 1
        if ready > t:
            return RESIDENT_NONE, ready, 0
        if a in self.pinned:
            return RESIDENT_DEVICE, t, 0
        if a in self.device:
            self.device.move_to_end(a)
            return RESIDENT_DEVICE, t, 0
        self._to_device(a)
        return RESIDENT_HOST, t + h2d_s, 0

    def residency(self, a: int) -> int:
        if a in self.pinned or a in self.device:
            return RESIDENT_DEVICE
        return RESIDENT_HOST if a in self.host else RESIDENT_NONE

    def _to_device(self, a: int) -> None:
        if a in self.pinned:
            return
        self.device[a] = None
        if len(self.device) > max(0, self.dcap - len(self.pinned)):
            self.device.popitem(last=False)

    def _evict_host(self, keep: int = -1) -> None:
        """Evict down to capacity; `keep` (the adapter a request is loading) stays."""
        spared = None
        while len(self.host) > self.hcap and self.heap:
            key, stamp, a = entry = heapq.heappop(self.heap)
            if a in self.host and a not in self.homes and stamp == self.last.get(a):
                if a == keep:
                    spared = entry
                    continue
                del self.host[a], self.last[a], self.count[a]
                self.device.pop(a, None)
        if spared is not None:
            heapq.heappush(self.heap, spared)


class Controller:
    """The placement controller's loop on the simulated clock: decayed cluster-wide rates
    -> `assign_tiers` -> `plan_homes`, every `period_s`."""

    def __init__(self, n_adapters: int, n_replicas: int, device: int, host: int, cfg: PlacementConfig):
        self.cfg, self.n, self.device, self.host = cfg, n_replicas, device, host
        self.slow = np.zeros(n_adapters)
        self.fast = np.zeros(n_adapters)
        self.order = rendezvous_order([f"adapter-{i}" for i in range(n_adapters)], [f"replica-{r}" for r in range(n_replicas)])
        self.tiers = np.full(n_adapters, 2, dtype=np.int8)
        self.rates = np.zeros(n_adapters)
        self.homes: dict[int, tuple[int, ...]] = {}
        self.stamp = 0.0

    def update(self, seen: np.ndarray, t: float) -> None:
        dt = t - self.stamp
        self.stamp = t
        counts = np.bincount(seen, minlength=self.slow.size)
        self.slow = self.slow * math.exp2(-dt / self.cfg.half_life_s) + counts
        self.fast = self.fast * math.exp2(-dt / self.cfg.rising_half_life_s) + counts
        self.rates = rates = effective_rates(self.slow, self.fast, self.cfg)
        self.tiers = assign_tiers(rates, self.n, self.device, self.host, self.cfg, previous=self.tiers)
        self.homes = plan_homes(rates, self.tiers, self.order, self.device, self.host, self.cfg, previous=self.homes)


def simulate(policy: str, tr: Trace, args, cfg: PlacementConfig, top1: np.ndarray) -> dict:
    n = args.replicas
    slots = math.ceil(1.25 * args.concurrency / n)
    cluster = Cluster(n, slots)
    rng = random.Random(args.seed)
    ours = policy == "ours"
    top1 = top1.tolist()
    reps = [TieredReplica(i, args.host_slots, args.device_slots, cfg.half_life_s, top1) if ours
            else LRUReplica(args.host_slots, args.device_slots) for i in range(n)]
    ctl = Controller(args.adapters, n, args.device_slots, args.host_slots, cfg) if ours else None
    arrivals, adapters, service = tr.arrivals.tolist(), tr.adapters.tolist(), tr.service.tolist()
    fetch_s, h2d_s = args.fetch_s, args.h2d_s
    where = [0, 0, 0]
    fetches, prefetches, away, served = 0, 0, 0, [0] * n
    delays: list[float] = []
    next_plan, last_plan_idx = args.period_s, 0
    tiers = rates = None
    homes_of: dict[int, tuple[int, ...]] = {}
    all_r = list(range(n))
    for j, (t, a, s) in enumerate(zip(arrivals, adapters, service)):
        measuring = j >= args.warmup
        cluster.advance(t)
        loads = cluster.loads
        if ours:
            if t >= next_plan:
                ctl.update(tr.adapters[last_plan_idx:j], t)
                last_plan_idx, next_plan = j, t + args.period_s
                tiers, rates, homes_of = ctl.tiers.tolist(), ctl.rates.tolist(), ctl.homes
                plan_fetches = 0
                for r, rep in enumerate(reps):
                    mine = {x for x, hs in homes_of.items() if r in hs and tiers[x] <= TIER_WARM}
                    pinned = {x for x in mine if tiers[x] == TIER_PINNED}
                    plan_fetches += rep.replan(mine, pinned, homes_of, tiers, t, fetch_s)
                if measuring:
                    fetches += plan_fetches
                    prefetches += plan_fetches
            hs = homes_of.get(a) or (top1[a],)
            res = [rep.residency(a) for rep in reps]
            r = rank_replicas(res, [i in hs for i in all_r], loads, cfg.route_load_bound, cfg.load_bound_floor)[0]
            away += measuring and r not in hs
            kind, ready, f = reps[r].serve(a, t, fetch_s, h2d_s, tiers or _COLD)
        else:
            if policy == "lru_least_loaded":
                low = min(loads)
                r = rng.choice([i for i in all_r if loads[i] == low])
            elif policy == "ray_default":
                have = [i for i in all_r if a in reps[i].host and loads[i] < slots]
                pool = have or [i for i in all_r if loads[i] < slots] or all_r
                pick = rng.sample(pool, 2) if len(pool) > 1 else pool
                r = min(pick, key=loads.__getitem__)
            else:  # lru_consistent_hash
                r = top1[a]
            kind, ready, f = reps[r].serve(a, t, fetch_s, h2d_s)
        delay = cluster.run(r, t, ready, s)
        if measuring:
            where[kind] += 1
            fetches += f
            served[r] += 1
            delays.append(delay)
    m = max(1, len(delays))
    return {"device": where[RESIDENT_DEVICE] / m, "host": where[RESIDENT_HOST] / m, "fetch": where[RESIDENT_NONE] / m,
            "fetches_per_1k": 1000.0 * fetches / m, "max_over_mean_load": max(served) / (sum(served) / n),
            "queue_p99_s": float(np.percentile(delays, 99)) if delays else 0.0,
            "prefetches_per_1k": 1000.0 * prefetches / m, "off_home": away / m}


class _AllCold:
    def __getitem__(self, i):
        return TIER_COLD


_COLD = _AllCold()


def static_bound(tr: Trace, args) -> float:
    k = min(args.adapters, args.replicas * args.host_slots)
    top = np.zeros(args.adapters, dtype=bool)
    top[np.argsort(-tr.probs, kind="stable")[:k]] = True
    return float(top[tr.adapters[args.warmup:]].mean())


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--adapters", type=int, default=10000)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--device-slots", type=int, default=64)
    p.add_argument("--host-slots", type=int, default=1024)
    p.add_argument("--concurrency", type=int, default=200)
    p.add_argument("--popularity", default="zipf:1.0", help="zipf:S or powerlaw:ALPHA (S-LoRA)")
    p.add_argument("--requests", type=int, default=300000, help="all requests, warm-up included")
    p.add_argument("--warmup", type=int, default=100000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--cv", type=float, default=1.0, help="coefficient of variation of inter-arrival gaps")
    p.add_argument("--service-s", type=float, default=1.0, help="mean decode time of a request")
    p.add_argument("--fetch-s", type=float, default=0.5, help="blob store -> host memory")
    p.add_argument("--h2d-s", type=float, default=0.005, help="host memory -> device slot")
    p.add_argument("--period-s", type=float, default=10.0, help="placement controller period")
    p.add_argument("--policies", default=",".join(("ours",) + BASELINES))
    p.add_argument("--placement", default="{}", help="PlacementConfig fields as JSON")
    args = p.parse_args(argv)
    if not 0 <= args.warmup < args.requests:
        raise SystemExit("need 0 <= --warmup < --requests")
    cfg = PlacementConfig(**json.loads(args.placement))
    t0 = time.perf_counter()
    tr = make_trace(args)
    top1 = rendezvous_order([f"adapter-{i}" for i in range(args.adapters)], [f"replica-{r}" for r in range(args.replicas)])[:, 0]
    results = {}
    for policy in args.policies.split(","):
        t1 = time.perf_counter()
        results[policy] = simulate(policy, tr, args, cfg, top1)
        print(f"{policy:<22} " + " ".join(f"{k}={v:.4f}" for k, v in results[policy].items())
              + f"  ({time.perf_counter() - t1:.1f} s)", flush=True)
    bound = static_bound(tr, args)
    print(f"static_bound fetch={1 - bound:.4f} (served without fetch <= {bound:.4f}); total {time.perf_counter() - t0:.1f} s")
    keys = ("device", "host", "fetch", "fetches_per_1k", "max_over_mean_load")
    out = {"ours": {k: round(results["ours"][k], 4) for k in keys} if "ours" in results else {},
           "baselines": {b: {k: round(results[b][k], 4) for k in keys} for b in BASELINES if b in results},
           "static_bound": {"fetch": round(1 - bound, 4)}}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
