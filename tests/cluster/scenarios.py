"""Multi-node scenarios on a real Ray cluster of one machine (tests/cluster/multinode.py), each printing its
figures and writing them as JSON for the test that ran it:

    python -m tests.cluster.scenarios cluster --redis URL --s3 URL --out report.json

(both scenarios, one after the other, on one cluster: starting it and the app is a third of the run).

node-loss: a head and three worker nodes, one LLM replica each; 12 adapters (two hot ones with a retired
first version) with weights of their own, so every answer's text says which adapter and version made it.
Bounded load (300 requests at concurrency 16, half of them streams) runs while the node of one replica, a home
of a hot adapter, is removed (its raylet and processes killed); then the node rejoins under load.

autoscaling: a head and three worker nodes, the LLM deployment autoscaled 1..3; load that needs three replicas,
then none: replicas and the placement plan's homes followed as Serve adds and removes replicas.

Each scenario runs in a process of its own: a Ray driver connects to one cluster for its life, and the test
process may already be the driver of the shared single-node Serve app (tests/deployments/serve_harness.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests.cluster import multinode as mn

HOT = ("mn-hot-a", "mn-hot-b")
OTHERS = tuple(f"mn-{i:02d}" for i in range(10))


def traffic(n: int, seed: int, base: str, stream_share: float = 0.5) -> list[tuple[str, int, bool]]:
    """n requests: 40% and 25% for the two hot adapters, 30% spread over the others, 5% the base model."""
    rng = random.Random(seed)
    models = rng.choices([HOT[0], HOT[1], *OTHERS, base], weights=[40, 25, *([3] * len(OTHERS)), 5], k=n)
    return [(m, rng.randrange(len(mn.PROMPTS)), rng.random() < stream_share) for m in models]


def run_load(url: str, plan, concurrency: int, during=None) -> list[mn.Outcome]:
    """The load to completion; `during(load)`, a coroutine function, runs beside it."""
    load = mn.Load(url, plan, concurrency)

    async def main():
        tasks = [load.run()] + ([during(load)] if during else [])
        await asyncio.gather(*tasks)

    asyncio.run(main())
    return load.outcomes


def hot_homes(url: str, keys: dict[str, str], stats: dict[str, dict]) -> dict[str, list[str]]:
    """hot family -> its planned homes that are live and hold its serving version."""
    view = mn.placement_view(url)
    out = {}
    for family in HOT:
        homes = view["adapters"].get(family, {}).get("homes", [])
        out[family] = [r for r in homes if r in stats and keys[family] in stats[r]["known"]]
    return out


def wrong_answers(outcomes, keys: dict[str, str], reference: dict) -> list[dict]:
    """Answers (whole ones) whose version header or text is not the one the adapter's serving version gives."""
    bad = []
    for o in outcomes:
        if o.kind != "ok":
            continue
        want_key = keys.get(o.adapter)
        if (want_key is not None and o.served_as != want_key) or o.text != reference[(o.adapter, o.prompt)]:
            bad.append(o.to_json())
    return bad


# ---------------------------------------------------------------------------------------------- node loss
def node_loss(cluster, workers, url: str, cfg, keys: dict[str, str]) -> dict:
    t_start = time.monotonic()
    base = cfg.base_model_name
    report: dict = {}
    if True:  # (one block: the cluster is the caller's)
        mn.deploy(cfg)
        report["deployed_s"] = round(time.monotonic() - t_start, 1)

        # The text each (model, prompt) answers with, greedy, asked one at a time.
        ref_plan = [(m, p, False) for m in (*HOT, *OTHERS, base) for p in range(len(mn.PROMPTS))]
        ref = run_load(url, ref_plan, concurrency=1)
        assert all(o.kind == "ok" for o in ref), mn.summarize(ref)
        reference = {(o.adapter, o.prompt): o.text for o in ref}
        per_prompt = [{reference[(m, p)] for m in (*HOT, *OTHERS, base)} for p in range(len(mn.PROMPTS))]
        report["distinct_reference_texts"] = [len(s) for s in per_prompt]  # of 13 models per prompt

        # Warm-up: the hot adapters pinned on two replicas each, loaded there.
        run_load(url, traffic(120, seed=1, base=base), concurrency=16)
        homed = mn.wait_for(lambda: (lambda h: h if all(len(v) >= 2 for v in h.values()) else None)(
            hot_homes(url, keys, mn.replica_stats())), timeout=60)
        assert homed, ("hot adapters not on two replicas", mn.placement_view(url))
        report["hot_homes_before"] = homed

        # The victim: a worker node whose only Serve actor is an LLM replica that homes the hottest adapter (the
        # controllers run on the head: AppConfig.controller_resources).
        actors = mn.serve_actor_nodes()
        replica_node = {name.rsplit("#", 1)[-1]: node for name, node in actors.items() if "#LLMServer#" in name}
        crowded = {node for name, node in actors.items() if "#LLMServer#" not in name}
        report["serve_actors"] = actors
        victim_rid = next((r for r in homed[HOT[0]] if r in replica_node and replica_node[r] not in crowded), None)
        assert victim_rid is not None, ("no home of the hot adapter on a node of its own", homed, actors)
        victim = next(w for w in workers if w.node_id == replica_node[victim_rid])
        victim_pid = mn.pid_of_actor(mn.llm_replicas()[victim_rid])
        report["victim_replica"] = victim_rid
        live = set(replica_node) - {victim_rid}

        marks: dict = {}

        def watch_rehome():  # until both hot adapters have two live homes holding them again
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                try:
                    homes = hot_homes(url, keys, {r: s for r, s in mn.replica_stats().items() if r != victim_rid})
                except Exception:  # noqa: BLE001 - the admin route during the loss
                    homes = {}
                if homes and all(len(set(v) - {victim_rid}) >= 2 for v in homes.values()):
                    marks["rehomed_s"] = round(time.monotonic() - marks["killed_at"], 1)
                    marks["hot_homes_after"] = homes
                    return
                time.sleep(0.5)

        watcher = threading.Thread(target=watch_rehome)

        async def kill_mid_run(load):
            # about a third of the way, at a moment a stream on the victim has begun (its first token came): how
            # fast the replicas answer must not decide whether the kill lands on a stream
            while len(load.outcomes) < 90 or not any(
                    o.stream and o.replica == victim_rid and o.tokens >= 1 for o in load.in_flight.values()):
                if len(load.outcomes) >= 240:
                    break  # none seen: the report's streams_on_lost_node_at_kill says so
                await asyncio.sleep(0.01)
            marks["killed_at"] = time.monotonic()
            await asyncio.get_running_loop().run_in_executor(None, mn.kill_node, cluster, victim, [victim_pid])
            marks["removed_s"] = round(time.monotonic() - marks["killed_at"], 2)
            watcher.start()

        outcomes = run_load(url, traffic(300, seed=2, base=base), concurrency=16, during=kill_mid_run)
        watcher.join()
        killed_at = marks.pop("killed_at")
        on_victim = [o for o in outcomes if o.replica == victim_rid]
        crossing = [o for o in on_victim if o.started < killed_at < o.ended]
        report["loss"] = {
            "requests": len(outcomes), "outcomes": mn.summarize(outcomes),
            "unary_failed": sum(1 for o in outcomes if not o.stream and o.kind != "ok"),
            "retried": sum(1 for o in outcomes if o.retries),
            "streams_on_lost_node_at_kill": sum(1 for o in crossing if o.stream),
            "their_outcomes": mn.summarize([o for o in crossing if o.stream]),
            "error_event_codes": sorted({o.code for o in outcomes if o.kind == "error_event"}),
            "failed_codes": sorted({str(o.code) for o in outcomes if o.kind == "failed"}),
            "hung": sum(1 for o in outcomes if o.kind == "hung"),
            "wrong_answers": wrong_answers(outcomes, keys, reference)[:5],
            "wrong_answer_count": len(wrong_answers(outcomes, keys, reference)),
            "served_after_kill_by_lost_replica": sum(1 for o in outcomes if o.replica == victim_rid
                                                     and o.kind == "ok" and o.started > killed_at + 1),
            "slowest_s": round(max(o.ended - o.started for o in outcomes), 2),
            **marks,
        }
        report["loss"]["bad_outcomes"] = [o.to_json() for o in outcomes if o.kind != "ok"][:8]

        # Rejoin under load: the node comes back; its replica starts and takes its share of the plan.
        before = {r: set(s["known"]) for r, s in mn.replica_stats().items()}
        rejoined_at = time.monotonic()
        back: dict = {}

        def running():
            return mn.running_replicas() >= 3 and set(mn.replica_stats()) - set(before)

        rejoin_outcomes: list = []

        def rejoin_load():  # loads back to back until the new replica is up and has settled
            i = 0
            while time.monotonic() - rejoined_at < 150 and "settled" not in back:
                rejoin_outcomes.extend(run_load(url, traffic(60, seed=10 + i, base=base), concurrency=16))
                i += 1

        # the homes each replica's own copy of the plan gave it, from the node's return on: a replica prefetches
        # what its copy says (synced every placement period), which the controller's view may have moved since
        homed_by_replica: dict[str, set] = {}

        def watch_homes():
            while "settled" not in back and time.monotonic() - rejoined_at < 150:
                for rid, s in mn.replica_stats().items():
                    homed_by_replica.setdefault(rid, set()).update(s.get("homes", ()))
                time.sleep(0.2)

        loader = threading.Thread(target=rejoin_load)
        loader.start()
        home_watcher = threading.Thread(target=watch_homes)
        home_watcher.start()
        mn.add_worker(cluster)  # (in the main thread: a node registers signal handlers)
        back["node_added_s"] = round(time.monotonic() - rejoined_at, 1)
        new_ids = mn.wait_for(running, timeout=120)
        back["replica_running_s"] = round(time.monotonic() - rejoined_at, 1) if new_ids else None
        if new_ids:
            new_id = next(iter(new_ids))
            # settled: the new replica's share of the plan loaded (its held set unchanged for 5 s); the families
            # the plan homed on it at any time meanwhile (a home can move while the plan takes it in)
            last, stable_since, homed_ever = None, time.monotonic(), set()
            while time.monotonic() - rejoined_at < 140:
                held = set(mn.replica_stats().get(new_id, {}).get("known", ()))
                homed_ever |= {f for f, a in mn.placement_view(url)["adapters"].items()
                               if new_id in a["homes"] and a["tier"] != "cold"}
                if held != last:
                    last, stable_since = held, time.monotonic()
                elif time.monotonic() - stable_since > 5:
                    break
                time.sleep(0.5)
            after = mn.replica_stats()
            view = mn.placement_view(url)
            back["new_replica"] = new_id
            back["new_replica_loaded"] = sorted(after.get(new_id, {}).get("known", ()))
            causes = after.get(new_id, {}).get("registered_by", {})
            # what it loaded by cause: the plan's prefetches of its homes, and requests' cold loads (the router
            # sends a cold adapter's request to the least loaded replica, which a new one is)
            back["new_replica_loaded_by"] = {c: sorted(k for k, why in causes.items() if why == c)
                                             for c in sorted(set(causes.values()))}
            back["new_replica_homes"] = sorted(f for f, a in view["adapters"].items() if new_id in a["homes"]
                                               and a["tier"] != "cold")
            back["new_replica_homes_ever"] = sorted(homed_ever | homed_by_replica.get(new_id, set()))
            back["others_loaded"] = {r: sorted(set(s["known"]) - before.get(r, set())) for r, s in after.items()
                                     if r != new_id}
            back["plan_replicas"] = view["replicas"]
            back["hot_homes"] = {f: view["adapters"].get(f, {}).get("homes") for f in HOT}
        back["settled"] = True
        loader.join()
        home_watcher.join()
        back["requests"] = len(rejoin_outcomes)
        back["outcomes"] = mn.summarize(rejoin_outcomes)
        back["errors"] = [o.to_json() for o in rejoin_outcomes if o.kind != "ok"][:5]
        back["wrong_answer_count"] = len(wrong_answers(rejoin_outcomes, keys, reference))
        report["rejoin"] = back
    report["total_s"] = round(time.monotonic() - t_start, 1)
    return report


# ---------------------------------------------------------------------------------------------- autoscaling
AUTOSCALING = {"min_replicas": 1, "initial_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 2,
               "upscale_delay_s": 1, "downscale_delay_s": 5, "metrics_interval_s": 0.5, "look_back_period_s": 2}


def autoscaling(url: str, cfg) -> dict:
    """The app autoscaled 1..3 (AppConfig.autoscaling): load at concurrency 12 until three replicas serve, then
    none until Serve is back to one; the replica count and the plan followed every half second."""
    from deployments.config import AppConfig

    t_start = time.monotonic()
    scaled = AppConfig.model_validate({**cfg.model_dump(mode="json"), "autoscaling": AUTOSCALING})
    mn.deploy(scaled)
    report: dict = {"deployed_s": round(time.monotonic() - t_start, 1), "config": AUTOSCALING}
    timeline: list = []  # (seconds, replicas RUNNING, the plan's replicas, hot family -> homes)
    stop = threading.Event()

    def follow():
        while not stop.is_set():
            try:
                view = mn.placement_view(url)
                timeline.append((round(time.monotonic() - t_start, 1), mn.running_replicas(), view["replicas"],
                                 {f: view["adapters"].get(f, {}).get("homes", []) for f in HOT}))
            except Exception:  # noqa: BLE001 - a transition
                pass
            stop.wait(0.5)

    follower = threading.Thread(target=follow)
    follower.start()
    outcomes: list = []
    try:
        up_at = None
        for i in range(12):  # loads back to back until three replicas have served for 5 s (or 12 rounds)
            outcomes += run_load(url, traffic(60, seed=100 + i, base=cfg.base_model_name), concurrency=12)
            if up_at is None and mn.running_replicas() >= 3:
                up_at = time.monotonic()
            if up_at is not None and time.monotonic() - up_at > 5:
                break
        report["up_s"] = None if up_at is None else round(up_at - t_start, 1)
        load_ended = time.monotonic()
        down = mn.wait_for(lambda: mn.running_replicas() == 1 and len(mn.placement_view(url)["replicas"]) == 1,
                           timeout=90)
        report["down_after_load_s"] = round(time.monotonic() - load_ended, 1) if down else None
        after = run_load(url, traffic(30, seed=200, base=cfg.base_model_name), concurrency=1)  # (one replica's worth)
        outcomes += after
    finally:
        stop.set()
        follower.join()
    report["requests"] = len(outcomes)
    report["outcomes"] = mn.summarize(outcomes)
    report["errors"] = [o.to_json() for o in outcomes if o.kind != "ok"][:5]
    report["max_running"] = max((t[1] for t in timeline), default=0)
    report["plan_sizes"] = [n for i, n in enumerate(len(t[2]) for t in timeline)
                            if i == 0 or n != len(timeline[i - 1][2])]  # the plan's replica count as it changed
    first = timeline[0][2] if timeline else []
    widest = max(timeline, key=lambda t: len(t[2]))[2] if timeline else []
    last = timeline[-1] if timeline else (0, 0, [], {})
    homes_seen = {r for t in timeline for hs in t[3].values() for r in hs}
    report["replicas_seen"] = sorted({r for t in timeline for r in t[2]})
    report["homes_on_added_replicas"] = sorted(homes_seen - set(first))
    report["final_replicas"] = last[2]
    report["final_hot_homes"] = last[3]
    report["widest_plan"] = widest
    # how long the plan kept a replica Serve had scaled in (a drained replica leaves it at once; one that just
    # stopped heartbeating would stay for the controller's replica_ttl_s)
    peak = next((i for i, t in enumerate(timeline) if t[1] >= 3), None)
    serve_one = next((t[0] for t in timeline[peak:] if t[1] == 1), None) if peak is not None else None
    plan_one = next((t[0] for t in timeline[peak:] if len(t[2]) == 1), None) if peak is not None else None
    report["plan_lag_after_scale_in_s"] = (None if serve_one is None or plan_one is None
                                           else round(plan_one - serve_one, 1))
    report["total_s"] = round(time.monotonic() - t_start, 1)
    return report


def cluster_run(redis_url: str, s3: str, root: Path) -> dict:
    """One cluster (a head, three worker nodes) for both scenarios, one after the other."""
    t_start = time.monotonic()
    cfg, _ = mn.cluster_config(root, redis_url, s3)
    keys = mn.register_adapters(cfg, root, [*HOT, *OTHERS], old_versions=HOT)
    cluster = mn.start_cluster(root)
    workers = [mn.add_worker(cluster) for _ in range(3)]
    report: dict = {"cluster_up_s": round(time.monotonic() - t_start, 1)}
    try:
        url = mn.start_serve()
        report["node_loss"] = node_loss(cluster, workers, url, cfg, keys)
        report["autoscaling"] = autoscaling(url, cfg)
    finally:
        mn.stop_cluster(cluster, root)
    report["total_s"] = round(time.monotonic() - t_start, 1)
    return report


SCENARIOS = {"cluster": cluster_run}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("scenario", choices=sorted(SCENARIOS))
    p.add_argument("--redis", required=True, help="redis:// URL of a running server")
    p.add_argument("--s3", required=True, help="S3 endpoint URL (moto's server)")
    p.add_argument("--out", type=Path, help="write the report here as JSON")
    args = p.parse_args(argv)
    from tests.deployments.serve_harness import cluster_env

    cluster_env()  # moto takes any; the nodes' processes inherit them
    root = Path(tempfile.mkdtemp(prefix="loraserve-multinode-"))
    try:
        report = SCENARIOS[args.scenario](args.redis, args.s3, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = json.dumps(report, default=str)
    print(f"MULTINODE_{args.scenario.upper().replace('-', '_')}_REPORT", text, flush=True)
    if args.out:
        args.out.write_text(text)
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
