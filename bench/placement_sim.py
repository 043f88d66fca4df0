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
from typing import Optional
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

    def drop(self, r: int) -> int:
        """Replica r is lost: its requests in flight with it (-> how many); its slots free."""
        n = self.loads[r]
        self.total -= n
        self.loads[r], self.ends[r] = 0, []
        self.free[r] = [0.0] * len(self.free[r])
        return n

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

    def wipe(self) -> None:
        self.host.clear()
        self.device.clear()


class TieredReplica:
    """Our replica: planned homes are protected (pinned ones on the device), the rest of host
    memory evicts by `router.placement.eviction_key` (tier, then decayed request count)."""

    def __init__(self, index: int, host: int, device: int, half_life_s: float, top1: list[int],
                 holders: Optional[dict] = None):
        self.index, self.top1 = index, top1
        self.holders = holders  # adapter -> replicas holding it, shared by all replicas (node mode's routing)
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
                self._hold(a, t + fetch_s)
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
            ready = t + fetch_s
            self._hold(a, ready)
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

    def _hold(self, a: int, ready: float) -> None:
        self.host[a] = ready
        if self.holders is not None:
            self.holders.setdefault(a, set()).add(self.index)

    def wipe(self) -> None:
        """The node is lost: host memory, device slots and the plan's share are gone."""
        if self.holders is not None:
            for a in self.host:
                self.holders[a].discard(self.index)
        self.host, self.last, self.count, self.heap = {}, {}, {}, []
        self.device.clear()
        self.pinned, self.homes = set(), set()

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
                if self.holders is not None:
                    self.holders[a].discard(self.index)
        if spared is not None:
            heapq.heappush(self.heap, spared)


class Controller:
    """The placement controller's loop on the simulated clock: decayed cluster-wide rates
    -> `assign_tiers` -> `plan_homes`, every `period_s`."""

    def __init__(self, n_adapters: int, n_replicas: int, device: int, host: int, cfg: PlacementConfig,
                 order: np.ndarray):
        self.cfg, self.n, self.device, self.host = cfg, n_replicas, device, host
        self.slow = np.zeros(n_adapters)
        self.fast = np.zeros(n_adapters)
        self.order = order  # rendezvous_order of adapters x replicas
        self.tiers = np.full(n_adapters, 2, dtype=np.int8)
        self.rates = np.zeros(n_adapters)
        self.homes: dict[int, tuple[int, ...]] = {}
        self.stamp = 0.0

    def update(self, seen: np.ndarray, t: float, alive: Optional[list[bool]] = None) -> None:
        dt = t - self.stamp
        self.stamp = t
        counts = np.bincount(seen, minlength=self.slow.size)
        self.slow = self.slow * math.exp2(-dt / self.cfg.half_life_s) + counts
        self.fast = self.fast * math.exp2(-dt / self.cfg.rising_half_life_s) + counts
        self.rates = rates = effective_rates(self.slow, self.fast, self.cfg)
        live = self.n if alive is None else sum(alive)
        self.tiers = assign_tiers(rates, live, self.device, self.host, self.cfg, previous=self.tiers)
        self.homes = plan_homes(rates, self.tiers, self.order, self.device, self.host, self.cfg, previous=self.homes,
                                alive=alive)


def simulate(policy: str, tr: Trace, args, cfg: PlacementConfig, order: np.ndarray) -> dict:
    n = args.replicas
    slots = math.ceil(1.25 * args.concurrency / n)
    cluster = Cluster(n, slots)
    rng = random.Random(args.seed)
    ours = policy == "ours"
    top1 = order[:, 0].tolist()
    nodes = Nodes(n, args, random.Random(args.seed + 1))
    holders: Optional[dict] = {} if ours and nodes.on else None  # node mode: route among candidates only
    if nodes.on and policy not in ("ours", "lru_least_loaded"):
        raise SystemExit(f"--replicas-per-node runs ours and lru_least_loaded only, not {policy}")
    reps = [TieredReplica(i, args.host_slots, args.device_slots, cfg.half_life_s, top1, holders) if ours
            else LRUReplica(args.host_slots, args.device_slots) for i in range(n)]
    ctl = Controller(args.adapters, n, args.device_slots, args.host_slots, cfg, order) if ours else None
    arrivals, adapters, service = tr.arrivals.tolist(), tr.adapters.tolist(), tr.service.tolist()
    fetch_s, h2d_s = args.fetch_s, args.h2d_s
    where = [0, 0, 0]
    fetches, prefetches, away, served, lost = 0, 0, 0, [0] * n, 0
    delays: list[float] = []
    next_plan, last_plan_idx = args.period_s, 0
    tiers = rates = None
    homes_of: dict[int, tuple[int, ...]] = {}
    all_r = list(range(n))
    measured_from = arrivals[min(args.warmup, len(arrivals) - 1)]
    for j, (t, a, s) in enumerate(zip(arrivals, adapters, service)):
        measuring = j >= args.warmup
        cluster.advance(t)
        if nodes.on:
            for r in nodes.step(t, measured_from):  # replicas of a node lost now: memory and requests gone
                reps[r].wipe()
                lost += measuring * cluster.drop(r)
        loads = cluster.loads
        if ours:
            if t >= next_plan:  # the controller learns of a loss at its next plan (the real one: replica_ttl_s)
                ctl.update(tr.adapters[last_plan_idx:j], t, nodes.alive if nodes.on else None)
                last_plan_idx, next_plan = j, t + args.period_s
                tiers, rates, homes_of = ctl.tiers.tolist(), ctl.rates.tolist(), ctl.homes
                mine_of: dict[int, set[int]] = {}
                for x, hs in homes_of.items():
                    if tiers[x] <= TIER_WARM:
                        for r in hs:
                            mine_of.setdefault(r, set()).add(x)
                plan_fetches = 0
                for r, rep in enumerate(reps):
                    if nodes.alive[r]:
                        mine = mine_of.get(r, set())
                        pinned = {x for x in mine if tiers[x] == TIER_PINNED}
                        plan_fetches += rep.replan(mine, pinned, homes_of, tiers, t, fetch_s)
                if measuring:
                    fetches += plan_fetches
                    prefetches += plan_fetches
            hs = homes_of.get(a) or (top1[a],)
            if holders is None:
                res = [rep.residency(a) for rep in reps]
                r = rank_replicas(res, [i in hs for i in all_r], loads, cfg.route_load_bound, cfg.load_bound_floor)[0]
            else:  # the same ranking over the replicas that can come first: homes, holders, the least loaded
                cand = {i for i in hs if nodes.alive[i]} | holders.get(a, set())
                cand.add(min(nodes.live, key=loads.__getitem__))
                cand = sorted(cand)
                res = [reps[i].residency(a) for i in cand]
                r = cand[rank_replicas(res, [i in hs for i in cand], [loads[i] for i in cand], cfg.route_load_bound,
                                       cfg.load_bound_floor, totals=(cluster.total, len(nodes.live)))[0]]
            away += measuring and r not in hs
            kind, ready, f = reps[r].serve(a, t, fetch_s, h2d_s, tiers or _COLD)
        else:
            if policy == "lru_least_loaded":
                live = nodes.live if nodes.on else all_r
                low = min(loads[i] for i in live)
                r = rng.choice([i for i in live if loads[i] == low])
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
    # a replica's load: requests it served per second it was up (a lost node's replicas were down a while)
    up = nodes.up_seconds(measured_from, arrivals[-1])
    per_s = [served[r] / up[r] for r in range(n) if up[r] > 0]
    out = {"device": where[RESIDENT_DEVICE] / m, "host": where[RESIDENT_HOST] / m, "fetch": where[RESIDENT_NONE] / m,
           "fetches_per_1k": 1000.0 * fetches / m, "max_over_mean_load": max(per_s) / (sum(per_s) / len(per_s)),
           "queue_p99_s": float(np.percentile(delays, 99)) if delays else 0.0,
           "prefetches_per_1k": 1000.0 * prefetches / m, "off_home": away / m}
    if nodes.on:
        out |= {"node_losses": nodes.losses, "lost_in_flight_per_1k": 1000.0 * lost / m}
    return out


class Nodes:
    """Replicas grouped `--replicas-per-node` to a node; every `--node-loss-every-s` a random live node is lost
    (its replicas' memory and the requests in flight on them) and comes back `--node-down-s` later, empty."""

    def __init__(self, n: int, args, rng: random.Random):
        self.per = args.replicas_per_node or n
        self.on = args.replicas_per_node > 0
        self.every, self.down_s, self.rng = args.node_loss_every_s, args.node_down_s, rng
        self.alive = [True] * n
        self.live = list(range(n))
        self.next_loss = self.every if self.on and self.every > 0 else math.inf
        self.back: list[tuple[float, int]] = []  # (when, node)
        self.down: list[tuple[int, float, float]] = []  # (node, from, to)
        self.losses = 0

    def step(self, t: float, measured_from: float) -> list[int]:
        """Nodes back by `t` rejoin; -> the replicas of a node lost at `t` (none most of the time)."""
        changed, lost = False, []
        while self.back and self.back[0][0] <= t:
            _, node = heapq.heappop(self.back)
            for r in self._replicas(node):
                self.alive[r] = True
            changed = True
        if t >= self.next_loss:
            up_nodes = sorted({r // self.per for r in self.live})
            if len(up_nodes) > 1:
                node = self.rng.choice(up_nodes)
                lost = self._replicas(node)
                for r in lost:
                    self.alive[r] = False
                heapq.heappush(self.back, (self.next_loss + self.down_s, node))
                self.down.append((node, self.next_loss, self.next_loss + self.down_s))
                self.losses += t >= measured_from
                changed = True
            self.next_loss += self.every
        if changed:
            self.live = [r for r, up in enumerate(self.alive) if up]
        return lost

    def _replicas(self, node: int) -> list[int]:
        return list(range(node * self.per, min(len(self.alive), (node + 1) * self.per)))

    def up_seconds(self, start: float, end: float) -> list[float]:
        up = [max(0.0, end - start)] * len(self.alive)
        for node, a, b in self.down:
            gone = max(0.0, min(b, end) - max(a, start))
            for r in self._replicas(node):
                up[r] -= gone
        return up


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
    p.add_argument("--replicas-per-node", type=int, default=0,
                   help="node mode: replicas grouped this many to a node (0: off); runs ours and lru_least_loaded")
    p.add_argument("--node-loss-every-s", type=float, default=0.0, help="node mode: a random node lost this often")
    p.add_argument("--node-down-s", type=float, default=300.0, help="node mode: a lost node rejoins this much later")
    p.add_argument("--placement", default="{}", help="PlacementConfig fields as JSON")
    args = p.parse_args(argv)
    if not 0 <= args.warmup < args.requests:
        raise SystemExit("need 0 <= --warmup < --requests")
    cfg = PlacementConfig(**json.loads(args.placement))
    t0 = time.perf_counter()
    tr = make_trace(args)
    order = rendezvous_order([f"adapter-{i}" for i in range(args.adapters)], [f"replica-{r}" for r in range(args.replicas)])
    results = {}
    for policy in args.policies.split(","):
        t1 = time.perf_counter()
        results[policy] = simulate(policy, tr, args, cfg, order)
        print(f"{policy:<22} " + " ".join(f"{k}={v:.4f}" for k, v in results[policy].items())
              + f"  ({time.perf_counter() - t1:.1f} s)", flush=True)
    bound = static_bound(tr, args)
    print(f"static_bound fetch={1 - bound:.4f} (served without fetch <= {bound:.4f}); total {time.perf_counter() - t0:.1f} s")
    keys = ("device", "host", "fetch", "fetches_per_1k", "max_over_mean_load")
    if args.replicas_per_node:
        keys += ("node_losses", "lost_in_flight_per_1k")
    out = {"ours": {k: round(results["ours"][k], 4) for k in keys} if "ours" in results else {},
           "baselines": {b: {k: round(results[b][k], 4) for k in keys} for b in BASELINES if b in results},
           "static_bound": {"fetch": round(1 - bound, 4)}}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
