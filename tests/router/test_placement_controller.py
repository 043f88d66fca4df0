"""The placement controller's loop body on a fake clock: tiers and homes from reported counts,
replication restored when a replica stops heartbeating, rising adapters warmed early."""

import pytest

from router.controller import PlacementController, PlacementView
from router.placement import PlacementConfig

REPLICAS = ["r0", "r1", "r2", "r3"]
ADAPTERS = [f"ad-{i:02d}" for i in range(40)]


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def controller(clock, **cfg):
    c = PlacementController(PlacementConfig(**cfg), device_slots=8, host_slots=16, replica_ttl_s=5.0, clock=clock)
    for r in REPLICAS:
        c.heartbeat(r)
    return c


def skewed_counts(scale=1.0):
    return {name: scale * 100.0 / (i + 1) for i, name in enumerate(ADAPTERS)}


def test_tiers_and_homes_from_reports():
    clock = Clock()
    c = controller(clock)
    c.report(skewed_counts())
    c.report({"ad-00": 50})  # a second ingress
    view = c.plan()
    tiers = {n: a["tier"] for n, a in view.adapters.items()}
    assert [n for n, t in tiers.items() if t == "pinned"] == ["ad-00", "ad-01", "ad-02", "ad-03"]
    assert sum(t == "warm" for t in tiers.values()) == 12
    for name in ("ad-00", "ad-01", "ad-02", "ad-03"):
        assert len(set(view.homes(name))) >= 2 and set(view.homes(name)) <= set(REPLICAS)
    assert len(view.homes("ad-00")) >= 3  # ~30% of the load: more homes than the minimum
    assert all(len(view.homes(n)) == 1 for n, t in tiers.items() if t == "cold")
    assert PlacementView.from_json(view.to_json()) == view
    mine = [view.for_replica(r) for r in REPLICAS]
    assert sum(t == "pinned" for m in mine for t in m.values()) == sum(len(view.homes(n)) for n in ADAPTERS[:4])


def test_a_dead_replica_is_replaced_as_home():
    clock = Clock()
    c = controller(clock)
    c.report(skewed_counts())
    before = c.plan()
    victim = before.homes("ad-01")[0]
    survivors = [r for r in before.homes("ad-01") if r != victim]
    clock.t += 6.0
    for r in REPLICAS:
        if r != victim:
            c.heartbeat(r)
    after = c.plan()
    assert victim not in after.replicas and after.version == before.version + 1
    assert victim not in after.homes("ad-01") and len(set(after.homes("ad-01"))) >= 2
    assert set(survivors) <= set(after.homes("ad-01"))
    assert all(victim not in a["homes"] for a in after.adapters.values())


def test_a_rising_adapter_is_warmed_before_its_long_run_rate_says_so():
    def run(rising_half_life_s):
        clock = Clock()
        c = controller(clock, half_life_s=300.0, rising_half_life_s=rising_half_life_s, rising_min_requests=4)
        c.report(skewed_counts(scale=10))
        c.plan()
        clock.t += 100.0
        for r in REPLICAS:
            c.heartbeat(r)
        c.report({"newcomer": 30})  # a burst: 30 requests in the last seconds
        return c.plan().adapters["newcomer"]["tier"]

    assert run(10.0) in ("pinned", "warm")
    assert run(300.0) == "cold"  # on the long clock alone it would still be cold


def test_counts_decay_and_no_replicas_means_no_homes():
    clock = Clock()
    c = PlacementController(PlacementConfig(half_life_s=10.0, rising_half_life_s=10.0), 8, 16, clock=clock)
    c.report({"a": 8})
    v1 = c.plan()
    assert v1.replicas == () and v1.homes("a") == []
    clock.t += 10.0
    assert c.plan().adapters["a"]["rate"] == pytest.approx(v1.adapters["a"]["rate"] / 2)
