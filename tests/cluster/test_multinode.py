"""The app across nodes: a real Ray cluster of a head and three worker nodes on this machine (one LLM replica per
node, `replica_resources`), the registry on a real Redis and moto's S3 server, the official `openai` client over
HTTP. One run of `tests/cluster/scenarios.py` (its own process: a Ray driver connects to one cluster) does both
scenarios; each test here reads its part of the report.

- node loss: 300 requests at concurrency 16 (half streams), the node of a replica homing both hot adapters killed
  a third of the way (every process on it SIGKILLed): no unary request fails, every stream on it ends with an
  error event, none hangs, no answer from the wrong adapter or version (each adapter's text is its own), the hot
  adapters on two live replicas again within 30 s; the node rejoins under load: its replica serves within 60 s,
  prefetching only its share of the plan (its homes; requests routed to it load cold adapters on demand,
  counted apart), with no request error.
- autoscaling: 1 -> 3 -> 1 replicas under load and after it, with no request error, the plan taking the new
  replicas in (homes on them) and dropping a scaled-in one at once.

About 3 minutes on a 2-core machine (cluster and app start-up are a third of it).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report(redis_server, moto_server, tmp_path_factory):
    out = tmp_path_factory.mktemp("multinode") / "report.json"
    run = subprocess.run([sys.executable, "-m", "tests.cluster.scenarios", "cluster", "--redis", redis_server,
                          "--s3", moto_server, "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0 and out.exists(), run.stdout[-3000:] + run.stderr[-6000:]
    data = json.loads(out.read_text())
    print("\nMULTINODE_REPORT", json.dumps(data))
    return data


def test_node_loss_under_load_loses_no_unary_request_and_ends_its_streams_with_an_error_event(report):
    r = report["node_loss"]
    loss = r["loss"]
    # each (adapter, version) answers with its own text: a wrong one would show
    assert min(r["distinct_reference_texts"]) >= 12, r["distinct_reference_texts"]
    assert loss["requests"] == 300
    # the placement and rollout controllers run on the head, beside Serve's (AppConfig.controller_resources)
    actors = r["serve_actors"]
    controllers = [n for name, n in actors.items() if "#PlacementController#" in name or "#CanaryController#" in name]
    assert len(controllers) == 2 and set(controllers) == {actors["SERVE_CONTROLLER_ACTOR"]}, actors
    assert loss["unary_failed"] == 0, loss
    assert loss["hung"] == 0 and not any(k.split(":")[1].startswith("dropped") for k in loss["outcomes"]), loss
    assert loss["wrong_answer_count"] == 0, loss["wrong_answers"]
    # the only failures are streams that were on the lost node when it went, each ended by an error event
    assert loss["streams_on_lost_node_at_kill"] >= 1, loss  # the kill did land under load
    bad = [o for o in loss["bad_outcomes"]]
    assert all(o["stream"] and o["kind"] == "error_event" and o["replica"] == r["victim_replica"] for o in bad), bad
    assert loss["error_event_codes"] in ([], ["replica_failed"]) and loss["failed_codes"] == [], loss
    # the router sent nothing more to it
    assert loss["served_after_kill_by_lost_replica"] == 0
    # replication restored: both hot adapters on two live replicas holding them, within 30 s
    assert loss.get("rehomed_s") is not None and loss["rehomed_s"] <= 30, loss
    for family, homes in loss["hot_homes_after"].items():
        assert len(set(homes) - {r["victim_replica"]}) >= 2, (family, homes)


def test_the_node_rejoins_under_load_with_bounded_adapter_loads_and_no_error(report):
    back = report["node_loss"]["rejoin"]
    assert back["replica_running_s"] is not None and back["replica_running_s"] <= 60, back
    assert back["new_replica"] in back["plan_replicas"] and len(back["plan_replicas"]) == 3
    assert back["requests"] > 0 and back["errors"] == [] and back["wrong_answer_count"] == 0, back
    # the rejoined replica prefetches its share of the plan (its pinned and warm homes), not every adapter: the
    # host slots planned homes may take would allow 16 x 0.75 = 12 of 12 adapters, "all at once"
    by_plan = {k.partition("@")[0] for k in back["new_replica_loaded_by"].get("placement", ())}
    assert by_plan, back  # it did take a share
    assert by_plan <= set(back["new_replica_homes_ever"]), back  # only homes the plan gave it
    assert len(by_plan) < 12 // 2, back
    # anything else it holds came from requests routed to it (cold loads), none from a rollout
    assert set(back["new_replica_loaded_by"]) <= {"placement", "request"}, back


def test_autoscaling_goes_one_to_three_and_back_with_placement_following(report):
    a = report["autoscaling"]
    assert a["up_s"] is not None and a["max_running"] == 3, a
    assert a["down_after_load_s"] is not None, a
    assert a["errors"] == [] and a["requests"] > 0, a
    assert a["plan_sizes"][0] == 1 and max(a["plan_sizes"]) == 3 and a["plan_sizes"][-1] == 1, a
    assert a["homes_on_added_replicas"], a  # new replicas took homes
    final = set(a["final_replicas"])
    assert all(set(h) <= final for h in a["final_hot_homes"].values()), a  # and gave them back
    # drained replicas left the plan at once, not a heartbeat TTL (10 s) later
    assert a["plan_lag_after_scale_in_s"] is not None and a["plan_lag_after_scale_in_s"] < 10, a
