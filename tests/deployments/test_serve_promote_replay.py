"""Through the real Serve app with the registry in a real redis-server: an LLM replica whose process is
paused (SIGSTOP) while an adapter is promoted misses the change feed's event, and once resumed (SIGCONT)
catches up from its Redis Streams position: it drops the old version, warms the promoted one, and the
requests it then serves for that adapter run the promoted version without a load.

The placement controller is off so that nothing but the change feed moves the adapter, and Serve's
health-check timeout is longer than the pause so that Serve keeps the paused replica (checked: same
actor, same process afterwards)."""

import os
import shutil
import signal
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.deployments import serve_harness

pytestmark = pytest.mark.slow

KEY = "sk-replay-e2e-0001"
ADMIN = "replay-admin-token"
APP = "promote-replay"
PROMPT = "def main():"
PAUSE_S = 4.0


@pytest.fixture(scope="module")
def app(redis_server):
    from deployments.bootstrap import bootstrap, demo_paths, make_registry, sha256_of_dir
    from deployments.config import load_config

    root = Path(tempfile.mkdtemp(prefix="loraserve-replay-"))
    (root / "in").mkdir()
    args = {
        "demo_recipe": "quick", "num_replicas": 2, "num_cpus_per_replica": 0.1, "ingress_num_cpus": 0.1,
        "placement_controller": False, "routing_stats_period_s": 0.5,
        "health_check_period_s": 2.0, "health_check_timeout_s": 30.0,  # a check outlives the pause
        "api_keys": {KEY: "e2e"}, "admin_token": ADMIN,
        "registry": {"redis_url": redis_server, "redis_prefix": f"replay{uuid.uuid4().hex[:8]}",
                     "blob_dir": str(root / "blobs"), "materialize_dir": str(root / "mat"),
                     "allowed_local_roots": [str(root / "in")]},
    }
    cfg = bootstrap(load_config(args, env={}))
    demo = demo_paths(cfg)["adapters"]
    names = sorted(demo)
    reg = make_registry(cfg)
    for version, src in ((1, names[0]), (2, names[1])):  # v1 active, v2 registered and ready
        d = root / "in" / f"promo-v{version}"
        shutil.copytree(demo[src], d)
        reg.register("promo", str(d), sha256_of_dir(d), cfg.base_model_name, actor="test", activate=version == 1)
    try:
        with serve_harness.deployed(cfg, APP, "/rp") as url:
            yield url, reg, names[1]
    finally:
        reg.close()
        shutil.rmtree(root, ignore_errors=True)


def llm_replicas():
    """replica id -> actor handle of every live LLM replica of this app."""
    return serve_harness.llm_replicas(APP)


def held(actor) -> list[str]:
    """The adapter versions a replica says it holds (what the router ranks on)."""
    import ray

    return ray.get(actor.record_routing_stats.remote(), timeout=30)["host_adapters"]


def complete(http, model):
    r = http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    return {"version": r.headers["x-loraserve-adapter"], "replica": r.headers["x-loraserve-replica"],
            "hit": r.headers["x-loraserve-adapter-hit"] == "1", "text": r.json()["choices"][0]["text"]}


def wait_for(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return time.monotonic()


def test_a_replica_paused_during_a_promote_serves_the_promoted_version_after_it_resumes(app):
    import ray

    base, reg, v2_source = app
    with httpx.Client(base_url=base, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as http:
        v2_text = complete(http, v2_source)["text"]  # the files promo v2 was built from, under their own name
        before = [complete(http, "promo") for _ in range(3)]
        assert {r["version"] for r in before} == {"promo@1"}
        assert v2_text != before[0]["text"]  # the versions are told apart by their output too
        victim = before[-1]["replica"]
        replicas = llm_replicas()
        actor = replicas.pop(victim)
        (other,) = replicas.values()
        # the victim alone holds promo (the router keeps an adapter where it is), so after the promote only
        # the change feed can bring promo@2 onto a replica before a request asks for it
        assert "promo@1" in held(actor) and not any(k.startswith("promo@") for k in held(other))
        pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
        consumer = f"replica:{victim}"

        os.kill(pid, signal.SIGSTOP)
        try:
            paused_at = time.monotonic()
            r = httpx.post(f"{base}/admin/v1/adapters/promo/promote", json={"version": 2},
                           headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
            assert r.status_code == 200 and r.json()["active_version"] == 2, r.text
            promoted_at = reg.metadata.revision()
            time.sleep(max(0.0, PAUSE_S - (time.monotonic() - paused_at)))
            # the paused replica has not consumed the promote: its saved feed position is behind it
            assert reg.metadata.feed_offset(consumer) < promoted_at
        finally:
            os.kill(pid, signal.SIGCONT)
        resumed_at = time.monotonic()

        def swapped():
            now = held(actor)
            return "promo@2" in now and "promo@1" not in now

        caught_up = wait_for(swapped, timeout=30, what="the resumed replica to drop promo@1 and warm promo@2")
        assert reg.metadata.feed_offset(consumer) >= promoted_at
        # still the same replica and process: Serve did not replace it during the pause
        assert victim in llm_replicas()
        assert ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30) == pid
        assert not any(k.startswith("promo@") for k in held(other))  # it never held promo: nothing to warm

        after = [complete(http, "promo") for _ in range(3)]
    print(f"caught up {caught_up - resumed_at:.1f} s after SIGCONT; served after: {after}")
    assert all(r["version"] == "promo@2" and r["text"] == v2_text for r in after), after
    # the router sends it where promo@2 lives: the resumed replica, which warmed it before any request asked
    assert after[0]["replica"] == victim and after[0]["hit"], after
