import random

import pytest

from router.assignments import AssignmentMemory
from router.policy import (
    AffinityConfig,
    ReplicaState,
    is_saturated,
    num_homes,
    rank_for_adapter,
    rank_for_base,
)
from router.keys import AdapterKey
from router.rendezvous import home_replicas

CFG = AffinityConfig()


def rs(rid, q=0, dev=(), host=(), mx=8, free=None, homes=None):
    return ReplicaState(rid, q, mx, frozenset(dev), frozenset(host), free, None if homes is None else frozenset(homes))


@pytest.mark.parametrize(
    "share,count,n,expected",
    [
        (0.9, 1, 3, 1),  # the first request is not "hot"
        (0.05, 100, 3, 1),  # below hot_share
        (0.1, 100, 3, 2),  # hot: at least hot_homes
        (0.5, 100, 3, 3),  # ceil(0.5 * 3 * 1.5) = 3
        (0.9, 100, 8, 8),  # capped at replicas
        (0.5, 100, 1, 1),
        (0.5, 100, 0, 0),
    ],
)
def test_num_homes(share, count, n, expected):
    assert num_homes(share, count, n, CFG) == expected


def test_config_validation():
    with pytest.raises(ValueError):
        AffinityConfig(cold_homes=0)
    with pytest.raises(ValueError):
        AffinityConfig(hot_share=0)
    with pytest.raises(ValueError):
        AffinityConfig(saturation=1.5)


def test_saturation():
    assert not is_saturated(rs("a", q=5), CFG)
    assert is_saturated(rs("a", q=6), CFG)  # floor(0.75 * 8)
    assert is_saturated(rs("a", q=0, free=0), CFG)
    assert not is_saturated(rs("a", q=0, mx=1), CFG)


def test_cold_adapter_stays_where_it_lives_even_when_that_replica_is_busier():
    reps = [rs("r0", q=0), rs("r1", q=3, dev=["x@1"]), rs("r2", q=0)]
    home = home_replicas("x", ["r0", "r1", "r2"], 1)[0]
    tiers = rank_for_adapter("x@1", reps, 1, CFG)
    assert tiers[0] == ["r1"]  # no second copy while the holder has room
    if home != "r1":
        assert tiers[1] == [home]
    assert sorted(sum(tiers, [])) == ["r0", "r1", "r2"]


def test_residency_before_homes_for_a_hot_adapter():
    ids = ["r0", "r1", "r2", "r3"]
    homes = home_replicas("x", ids, 2)
    holder = next(i for i in ids if i not in homes)
    reps = [rs(i, q=1, host=["x"] if i == holder else []) for i in ids]
    tiers = rank_for_adapter("x", reps, 2, CFG)
    assert tiers[0] == [holder]  # already there: no load
    assert set(tiers[1] + tiers[2]) == set(homes)


def test_planned_homes_reported_by_replicas_win_over_rendezvous():
    ids = ["r0", "r1", "r2", "r3"]
    planned = next(i for i in ids if i not in home_replicas("x", ids, 1))
    reps = [rs(i, q=0, homes={"x"} if i == planned else set()) for i in ids]
    assert rank_for_adapter("x@2", reps, 1, CFG)[0] == [planned]


def test_cold_new_adapter_goes_to_its_home():
    reps = [rs(f"r{i}") for i in range(4)]
    for i in range(20):
        key = f"ad{i}@1"
        tiers = rank_for_adapter(key, reps, 1, CFG)
        assert tiers[0] == home_replicas(f"ad{i}", [r.replica_id for r in reps], 1)


def test_versions_share_homes():
    reps = [rs(f"r{i}") for i in range(5)]
    assert rank_for_adapter("x@1", reps, 1, CFG)[0] == rank_for_adapter("x@2", reps, 1, CFG)[0]
    assert AdapterKey.family("x@2") == "x" and AdapterKey.family("x") == "x"


@pytest.mark.parametrize("text, key", [("sql@3", AdapterKey("sql", 3)), ("a.b-c_1@12", AdapterKey("a.b-c_1", 12))])
def test_adapter_key_round_trips(text, key):
    assert AdapterKey.parse(text) == key and str(key) == text and AdapterKey.family(text) == key.name


@pytest.mark.parametrize("text", ["sql", "sql@", "@3", "sql@v3", "sql@-1", "a@b@2"])
def test_adapter_key_refuses_anything_but_name_at_version(text):
    with pytest.raises(ValueError):
        AdapterKey.parse(text)


def test_device_before_host_residency_in_tier0():
    reps = [rs("r0", q=0, host=["x"]), rs("r1", q=2, dev=["x"])]
    assert rank_for_adapter("x", reps, 1, CFG)[0][0] == "r1"


def test_spills_when_preferred_saturated():
    home = home_replicas("x", ["r0", "r1", "r2"], 1)[0]
    others = [r for r in ["r0", "r1", "r2"] if r != home]
    reps = [rs(home, q=7, dev=["x"]), rs(others[0], q=2), rs(others[1], q=1)]
    tiers = rank_for_adapter("x", reps, 1, CFG)
    assert tiers[:2] == [[others[1]], [others[0]]]  # spill, least loaded first
    assert tiers[2] == [home]  # saturated preferred still beats nothing


def test_bounded_load_spills_a_hot_holder_far_above_the_mean():
    reps = [rs("r0", q=12, mx=32, dev=["x"]), rs("r1", q=1, mx=32), rs("r2", q=0, mx=32)]
    # bound = max(4, ceil(1.6 * 14 / 3)) = 8: r0 is over it, though far from saturated
    assert rank_for_adapter("x", reps, 1, CFG)[-1] == ["r0"]
    reps[0] = rs("r0", q=3, mx=32, dev=["x"])  # bound max(4, ceil(1.6 * 5 / 3)) = 4
    assert rank_for_adapter("x", reps, 1, CFG)[0] == ["r0"]


def test_spill_prefers_replicas_holding_it_in_host_memory_on_tie():
    reps = [rs("a", q=9, dev=["x"]), rs("b", q=1), rs("c", q=1, host=["y"])]
    # 'x' homed somewhere; force 1 home = the saturated one by making it resident
    tiers = rank_for_adapter("y", reps, 1, CFG)
    assert "c" in tiers[0]


def test_hot_adapter_spreads_over_its_homes():
    reps = [rs(f"r{i}") for i in range(4)]
    homes = set(home_replicas("hot", [r.replica_id for r in reps], 2))
    rng = random.Random(0)
    firsts = {rank_for_adapter("hot", reps, 2, CFG, rng)[0][0] for _ in range(50)}
    assert firsts == homes


def test_everything_saturated_still_routes_preferred_first():
    reps = [rs("r0", q=8, dev=["x"]), rs("r1", q=8)]
    tiers = rank_for_adapter("x", reps, 1, CFG)
    assert tiers[0][0] == "r0"


def test_base_power_of_two():
    reps = [rs("r0", q=5), rs("r1", q=1), rs("r2", q=3)]
    rng = random.Random(1)
    seen = set()
    for _ in range(50):
        (tier,) = rank_for_base(reps, rng)
        assert len(tier) == 2
        qs = {r.replica_id: r.queue_len for r in reps}
        assert qs[tier[0]] <= qs[tier[1]]
        seen.update(tier)
    assert seen == {"r0", "r1", "r2"}
    assert rank_for_base([]) == []
    assert rank_for_base([rs("only")]) == [["only"]]


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_assignment_memory_bridges_until_report_contradicts():
    clock = Clock()
    mem = AssignmentMemory(ttl_s=30, clock=clock)
    mem.note("x@1", "r0")
    assert mem.adapters_on("r0", frozenset(), None) == {"x@1"}
    assert mem.adapters_on("r1", frozenset(), None) == frozenset()
    # a report older than the assignment does not contradict it
    assert mem.adapters_on("r0", frozenset(), 99.0) == {"x@1"}
    clock.t = 101.0
    # a newer report that lists it: still believed; one that does not: forgotten
    assert mem.adapters_on("r0", frozenset({"x@1"}), 100.5) == {"x@1"}
    assert mem.adapters_on("r0", frozenset(), 100.5) == frozenset()


def test_assignment_memory_expires():
    clock = Clock()
    mem = AssignmentMemory(ttl_s=5, clock=clock)
    mem.note("x", "r0")
    clock.t += 6
    assert mem.adapters_on("r0", frozenset(), None) == frozenset()


def test_rank_replicas_over_candidates_with_the_clusters_totals_picks_as_over_all():
    """The simulator's large-cluster path: ranking only homes, holders and the least loaded replica, with the
    whole cluster's in-flight total for the bound, picks the replica the full ranking puts first."""
    import random

    from router.policy import RESIDENT_DEVICE, RESIDENT_HOST, RESIDENT_NONE, rank_replicas

    rng = random.Random(7)
    for _ in range(500):
        n = rng.randrange(3, 40)
        loads = [rng.randrange(0, 6) for _ in range(n)]
        res = [rng.choice([RESIDENT_NONE] * 6 + [RESIDENT_HOST, RESIDENT_DEVICE]) for _ in range(n)]
        home = [rng.random() < 0.1 for _ in range(n)]
        full = rank_replicas(res, home, loads, 1.6, 2)[0]
        cand = sorted({i for i in range(n) if home[i] or res[i] != RESIDENT_NONE}
                      | {min(range(n), key=loads.__getitem__)})
        sub = rank_replicas([res[i] for i in cand], [home[i] for i in cand], [loads[i] for i in cand], 1.6, 2,
                            totals=(sum(loads), n))[0]
        assert cand[sub] == full or (loads[cand[sub]] == loads[full] and res[cand[sub]] == res[full]
                                     and home[cand[sub]] == home[full])
