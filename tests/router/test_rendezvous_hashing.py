from collections import Counter

import pytest

from router.rendezvous import home_replicas, rendezvous_score


def test_score_is_stable_and_key_dependent():
    assert rendezvous_score("a", "r1") == rendezvous_score("a", "r1")
    assert rendezvous_score("a", "r1") != rendezvous_score("b", "r1")


@pytest.mark.parametrize("k", [0, 1, 2, 3, 5])
def test_home_replicas_is_a_prefix_of_the_full_ranking(k):
    nodes = ["r1", "r2", "r3", "r4"]
    full = home_replicas("adapter-7", nodes, len(nodes))
    assert sorted(full) == sorted(nodes)
    assert home_replicas("adapter-7", nodes, k) == full[: min(k, len(nodes))]
    assert home_replicas("adapter-7", list(reversed(nodes)), k) == full[:k]  # order-free


def test_removing_a_replica_only_moves_its_adapters():
    nodes = [f"r{i}" for i in range(5)]
    keys = [f"adapter-{i}" for i in range(400)]
    before = {k: home_replicas(k, nodes, 1)[0] for k in keys}
    after = {k: home_replicas(k, nodes[:-1], 1)[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "r4" for k in moved)


def test_homes_spread_evenly():
    nodes = ["r0", "r1", "r2"]
    load = Counter(home_replicas(f"a{i}", nodes, 1)[0] for i in range(3000))
    assert min(load.values()) > 800
