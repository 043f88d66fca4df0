"""`bench/placement_sim.py` on a small trace: the JSON it ends with, and that it runs the
policy code the controller and router run (no second implementation)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SIM = ROOT / "bench" / "placement_sim.py"
KEYS = {"device", "host", "fetch", "fetches_per_1k", "max_over_mean_load"}
SMALL = ["--adapters", "2000", "--replicas", "4", "--device-slots", "16", "--host-slots", "256",
         "--concurrency", "60", "--requests", "40000", "--warmup", "15000", "--seed", "3", "--popularity", "zipf:1.2"]


@pytest.fixture(scope="module")
def result():
    out = subprocess.run([sys.executable, str(SIM), *SMALL], capture_output=True, text=True, check=True,
                         cwd=ROOT, timeout=240)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_last_line_is_the_named_json(result):
    assert set(result) == {"ours", "baselines", "static_bound"}
    assert set(result["ours"]) == KEYS
    assert set(result["baselines"]) == {"lru_least_loaded", "ray_default", "lru_consistent_hash"}
    assert all(set(v) == KEYS for v in result["baselines"].values())
    assert set(result["static_bound"]) == {"fetch"}
    for r in [result["ours"], *result["baselines"].values()]:
        assert r["device"] + r["host"] + r["fetch"] == pytest.approx(1.0, abs=1e-3)


def test_ours_fetches_less_and_balances_load(result):
    ours, base = result["ours"], result["baselines"]
    assert ours["fetches_per_1k"] <= 0.7 * base["lru_least_loaded"]["fetches_per_1k"]
    assert ours["fetches_per_1k"] <= 0.7 * base["ray_default"]["fetches_per_1k"]
    assert ours["fetch"] <= base["lru_consistent_hash"]["fetch"] + 0.01
    assert ours["max_over_mean_load"] <= 1.3 < base["lru_consistent_hash"]["max_over_mean_load"]
    assert ours["fetch"] >= result["static_bound"]["fetch"] - 0.005  # no policy beats the bound by much


def test_sim_runs_the_router_packages_policy_functions():
    sys.path.insert(0, str(SIM.parent))
    try:
        import placement_sim
    finally:
        sys.path.remove(str(SIM.parent))
    import router.placement as placement
    import router.policy as policy

    for name in ("assign_tiers", "plan_homes", "effective_rates", "eviction_key", "rendezvous_order"):
        assert getattr(placement_sim, name) is getattr(placement, name)
    assert placement_sim.rank_replicas is policy.rank_replicas
    src = SIM.read_text()
    assert "def rank_replicas" not in src and "def plan_homes" not in src


NODE_LOSS = ["--adapters", "2000", "--replicas", "16", "--replicas-per-node", "4", "--device-slots", "16",
             "--host-slots", "256", "--concurrency", "32", "--service-s", "2", "--requests", "40000", "--warmup",
             "10000", "--period-s", "10", "--seed", "3", "--policies", "ours,lru_least_loaded"]


def _sim(*extra):
    out = subprocess.run([sys.executable, str(SIM), *NODE_LOSS, *extra], capture_output=True, text=True,
                         check=True, cwd=ROOT, timeout=240)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_node_mode_loses_nodes_and_ours_still_fetches_less_than_lru():
    """Four nodes of four replicas, one lost every 120 simulated seconds for 60 s: losses happen and cost requests
    in flight; ours (homes re-planned over the live replicas) still fetches far less than per-replica LRU, and
    no replica takes much more than its share of the time it was up."""
    lost = _sim("--node-loss-every-s", "120", "--node-down-s", "60")
    calm = _sim("--node-loss-every-s", "0")
    assert lost["ours"]["node_losses"] >= 3 and calm["ours"]["node_losses"] == 0
    assert lost["ours"]["lost_in_flight_per_1k"] > 0 == calm["ours"]["lost_in_flight_per_1k"]
    assert lost["ours"]["fetches_per_1k"] <= 0.7 * lost["baselines"]["lru_least_loaded"]["fetches_per_1k"]
    assert lost["ours"]["fetches_per_1k"] > calm["ours"]["fetches_per_1k"]  # a lost node's adapters are fetched again
    assert lost["ours"]["max_over_mean_load"] <= 1.5
