"""The pure placement policy: tiers, homes, replica scoring, eviction order."""

import math

import numpy as np
import pytest

from router.placement import (
    TIER_COLD, TIER_PINNED, TIER_WARM, PlacementConfig, assign_tiers, bump_count, effective_rates, eviction_key,
    plan_homes, rendezvous_order, wanted_homes,
)
from router.policy import RESIDENT_DEVICE, RESIDENT_HOST, RESIDENT_NONE, rank_replicas

N, DEV, HOST = 8, 64, 1024


def zipf_rates(n, s=1.0):
    return 1.0 / np.arange(1, n + 1) ** s


def order_for(n_adapters, n_replicas=N):
    return rendezvous_order([f"a{i}" for i in range(n_adapters)], [f"r{j}" for j in range(n_replicas)])


def test_tiers_split_10_30_60_by_rate_when_capacity_allows():
    rates = zipf_rates(100)[::-1].copy()  # the highest rate last: tiers follow rate, not index
    tiers = assign_tiers(rates, N, DEV, HOST, PlacementConfig())
    assert np.bincount(tiers, minlength=3).tolist() == [10, 30, 60]
    assert set(np.flatnonzero(tiers == TIER_PINNED)) == set(range(90, 100))


def test_tiers_are_configurable_and_unseen_adapters_stay_cold():
    rates = np.array([5.0, 4.0, 3.0, 2.0, 0.0, 0.0])
    tiers = assign_tiers(rates, N, DEV, HOST, PlacementConfig(pinned_share=0.25, warm_share=0.5))
    assert tiers.tolist() == [TIER_PINNED, TIER_WARM, TIER_WARM, TIER_COLD, TIER_COLD, TIER_COLD]


def test_pinned_tier_capped_by_device_room():
    cfg = PlacementConfig()
    tiers = assign_tiers(zipf_rates(10000), N, DEV, HOST, cfg)
    n_pin = int((tiers == TIER_PINNED).sum())
    # 2 copies of each pinned adapter must fit in the pinned part of the device slots
    assert 0 < n_pin * cfg.min_pinned_homes <= N * DEV * cfg.pinned_device_fraction
    assert int((tiers == TIER_WARM).sum()) == 3000


def test_pinned_copies_capped_by_host_room_in_a_small_cluster():
    rates = zipf_rates(20, 1.1)
    tiers = assign_tiers(rates, 2, 8, 8, PlacementConfig())  # 16 host slots for 20 adapters
    assert int((tiers == TIER_PINNED).sum()) == 1  # one extra copy: 0.1 x 16 slots
    assert int((tiers == TIER_PINNED).sum()) == 0 or tiers[0] == TIER_PINNED


def test_hysteresis_keeps_an_incumbent_at_the_boundary():
    cfg = PlacementConfig(pinned_share=0.5, warm_share=0.5)
    prev = assign_tiers(np.array([10.0, 9.0]), N, DEV, HOST, cfg)
    assert prev.tolist() == [TIER_PINNED, TIER_WARM]
    slightly_ahead = np.array([9.0, 10.0])
    assert assign_tiers(slightly_ahead, N, DEV, HOST, cfg, previous=prev).tolist() == [TIER_PINNED, TIER_WARM]
    far_ahead = np.array([5.0, 10.0])
    assert assign_tiers(far_ahead, N, DEV, HOST, cfg, previous=prev).tolist() == [TIER_WARM, TIER_PINNED]


def test_rising_adapter_is_rated_on_the_fast_clock_only_with_enough_requests():
    cfg = PlacementConfig(half_life_s=300, rising_half_life_s=30, rising_min_requests=4)
    slow, fast = np.array([10.0, 1.0, 5.0]), np.array([1.0, 1.0, 5.0])
    rates = effective_rates(slow, fast, cfg)
    assert rates[0] == pytest.approx(10 * math.log(2) / 300)
    assert rates[1] == pytest.approx(math.log(2) / 300)  # one request promotes nothing
    assert rates[2] == pytest.approx(5 * math.log(2) / 30)  # rising: 10x the slow rate


@pytest.mark.parametrize("share,tier,expected", [(0.0, TIER_PINNED, 2), (0.0, TIER_WARM, 1), (0.1, TIER_WARM, 2),
                                                 (0.4, TIER_PINNED, 5), (0.9, TIER_PINNED, 8)])
def test_homes_grow_with_share_of_load(share, tier, expected):
    assert wanted_homes(share, tier, N, PlacementConfig()) == expected


def plan(rates, cfg=PlacementConfig(), previous=None, alive=None, prev_tiers=None):
    tiers = assign_tiers(rates, N, DEV, HOST, cfg, previous=prev_tiers)
    return tiers, plan_homes(rates, tiers, order_for(len(rates)), DEV, HOST, cfg, previous=previous, alive=alive)


def test_pinned_adapters_get_two_distinct_homes_and_cold_ones_one():
    rates = zipf_rates(2000)
    tiers, homes = plan(rates)
    order = order_for(2000)
    for a in np.flatnonzero(tiers == TIER_PINNED):
        assert len(set(homes[a])) >= 2
    for a in np.flatnonzero(tiers == TIER_COLD):
        assert len(homes[a]) == 1
        assert homes[a][0] == order[a][0]  # its rendezvous home


def test_bounded_load_spreads_a_hot_adapter():
    rates = zipf_rates(2000, s=1.5)  # the top adapter has ~38% of the load
    cfg = PlacementConfig()
    tiers, homes = plan(rates, cfg)
    assert len(homes[0]) >= 5
    load = np.zeros(N)
    for a, hs in homes.items():
        for r in hs:
            load[r] += rates[a] / len(hs)
    assert load.max() / load.mean() <= cfg.load_bound + 1e-9


def test_unbounded_placement_would_overload_one_replica():
    """The same skew with one home per adapter (plain hashing) breaks the bound the plan keeps."""
    rates = zipf_rates(2000, s=1.5)
    top1 = order_for(2000)[:, 0]
    load = np.bincount(top1, weights=rates, minlength=N)
    assert load.max() / load.mean() > 1.3


def test_previous_homes_are_kept_and_a_dead_replica_is_replaced():
    rates = zipf_rates(2000)
    tiers, homes = plan(rates)
    tiers2, again = plan(rates * 1.01, previous=homes, prev_tiers=tiers)
    assert again == homes  # same rates (scaled): nothing moves
    pinned = int(np.flatnonzero(tiers == TIER_PINNED)[0])
    dead = homes[pinned][0]
    alive = [r != dead for r in range(N)]
    _, after = plan(rates, previous=homes, alive=alive, prev_tiers=tiers)
    assert dead not in after[pinned] and len(set(after[pinned])) >= 2
    assert homes[pinned][1] in after[pinned]  # the surviving home stays
    assert all(dead not in hs for hs in after.values())


def test_rank_device_over_host_over_none_then_home_then_load():
    res = [RESIDENT_NONE, RESIDENT_HOST, RESIDENT_DEVICE, RESIDENT_NONE]
    assert rank_replicas(res, [False] * 4, [0, 3, 5, 0], 1.5, load_bound_floor=8)[:2] == [2, 1]
    # equal residency: a home first, then the less loaded
    assert rank_replicas([0, 0, 0, 0], [False, False, True, False], [0, 1, 2, 3], 1.5, 8)[0] == 2
    assert rank_replicas([1, 1, 0, 0], [True, True, False, False], [4, 2, 0, 0], 1.5, 8)[0] == 1


def test_rank_bounded_load_skips_an_overloaded_holder():
    res = [RESIDENT_DEVICE, RESIDENT_NONE, RESIDENT_NONE, RESIDENT_NONE]
    loads = [10, 1, 1, 0]  # bound = max(2, ceil(1.25 * 13 / 4)) = 5
    ranked = rank_replicas(res, [True, False, False, False], loads, 1.25, 2)
    assert ranked[0] != 0 and ranked[-1] == 0
    assert rank_replicas(res, [True, False, False, False], [2, 2, 2, 1], 1.25, 2)[0] == 0  # within the bound (3)
    assert rank_replicas(res, [True] * 4, [0, 0, 0, 0], 1.25, 2, full=[True, False, False, False])[0] != 0


def test_eviction_order():
    hl = 100.0
    # a copy homed elsewhere goes before anything homed here, whatever its popularity
    assert eviction_key(False, TIER_PINNED, 50.0, 10.0, hl) < eviction_key(True, TIER_COLD, 1.0, 0.0, hl)
    assert eviction_key(True, TIER_COLD, 50.0, 10.0, hl) < eviction_key(True, TIER_WARM, 1.0, 0.0, hl)
    # popularity, not recency: 8 requests 100 s ago beat 1 request just now
    assert eviction_key(True, TIER_COLD, 1.0, 100.0, hl) < eviction_key(True, TIER_COLD, 8.0, 0.0, hl)


@pytest.mark.parametrize("c1,s1,c2,s2", [(3.0, 0.0, 1.0, 50.0), (1.0, 0.0, 1.5, 200.0), (10.0, 40.0, 2.0, 300.0)])
def test_eviction_key_orders_like_decayed_counts_at_any_time(c1, s1, c2, s2):
    hl = 100.0
    for now in (300.0, 1000.0):
        v1, v2 = c1 * 2 ** (-(now - s1) / hl), c2 * 2 ** (-(now - s2) / hl)
        k1, k2 = eviction_key(True, TIER_COLD, c1, s1, hl), eviction_key(True, TIER_COLD, c2, s2, hl)
        assert (v1 < v2) == (k1 < k2)
    assert bump_count(2.0, 0.0, 100.0, hl) == pytest.approx(2.0)


def test_config_validation():
    with pytest.raises(ValueError):
        PlacementConfig(pinned_share=0.8, warm_share=0.3)
    with pytest.raises(ValueError):
        PlacementConfig(load_bound=0.9)
    with pytest.raises(ValueError):
        PlacementConfig(rising_half_life_s=600, half_life_s=300)
