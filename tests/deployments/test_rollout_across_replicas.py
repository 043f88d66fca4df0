"""A rollout judged on every replica: two real `LLMServer` replicas (each its real engine on the quick toy model, a
real SQLite registry) serve the canary's traffic between them, and the rollout controller (RolloutRunner) reads
both replicas' reports, as the served app's controller reads them through the placement controller (no Ray here:
the replicas are called directly, the transport is what is left out).

Replica B's node holds a corrupted copy of the canary's files (its blob directory), so the canary fails there and
only there: its share of the window is the regression, and the decision, made on both replicas together, rolls
the canary back, while the same thresholds on replica A's share alone would have passed it."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from deployments.bootstrap import bootstrap, demo_paths, make_registry, sha256_of_dir
from deployments.canary import GoldenClient
from deployments.config import load_config
from deployments.data_plane.protocol import GenerateRequest
from deployments.engine_settings import engine_config
from deployments.replica.llm_server import LLMServer
from registry.canary_analysis import judge, window
from registry.canary_runner import RolloutRunner
from tests.deployments.test_serve_rollouts import _variant

GREEDY = {"max_tokens": 6, "temperature": 0.0}
POLICY = {"steps": [0.5], "window_requests": 6, "window_s": 0, "min_stable_requests": 4,
          "thresholds": {"min_drafted_tokens": 4, "ttft_p50_ratio": 10, "ttft_p99_ratio": 10, "tpot_p50_ratio": 10,
                         "tpot_p99_ratio": 10, "latency_slack_s": 1.0}}


class LocalLLM:
    """An LLMClient that calls one replica directly (GoldenClient's neighbour)."""

    def __init__(self, server: LLMServer):
        self.server = server

    async def stream(self, req):
        async for chunk in self.server.generate(req):
            yield chunk


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("split")
    settings = {"registry_db": str(tmp / "r.db"), "blob_dir": str(tmp / "blobs"), "materialize_dir": str(tmp / "mat"),
                "allowed_local_roots": [str(tmp / "in")], "poll_interval_s": 0.1}
    cfg = bootstrap(load_config({"demo_recipe": "quick", "registry": settings}, env={}))
    paths = demo_paths(cfg)
    reg = make_registry(cfg)
    src = Path(paths["adapters"][sorted(paths["adapters"])[0]])
    for version, scale in ((1, 1.0), (2, 1.0001)):  # v2: the weights retrained (other bytes, same answers)
        d = _variant(src, tmp / "in" / f"split-v{version}", scale)
        reg.register("split", str(d), sha256_of_dir(d), cfg.base_model_name, actor="test", activate=version == 1)
    # replica B's node: its own blob directory, where the canary's weights file is corrupted
    shutil.copytree(tmp / "blobs", tmp / "blobs-b")
    canary_blob = reg.get("split").versions[2].files["adapter_model.safetensors"].sha256
    (bad,) = [p for p in (tmp / "blobs-b").rglob("*") if p.is_file() and canary_blob in p.name]
    bad.write_bytes(b"\0" * bad.stat().st_size)
    cfg_b = cfg.model_copy(update={"registry": {**settings, "blob_dir": str(tmp / "blobs-b"),
                                                "materialize_dir": str(tmp / "mat-b")}})
    yield cfg, cfg_b, paths, reg
    reg.close()


def test_a_regression_on_one_replicas_share_of_the_canary_rolls_it_back(env):
    from engine_ext import AsyncLLMEngine

    cfg, cfg_b, paths, reg = env
    reg_b = make_registry(cfg_b)
    engines = [AsyncLLMEngine(engine_config(cfg, paths["model"])) for _ in range(2)]
    servers = {"ra": LLMServer(cfg, engines[0], reg, "ra"), "rb": LLMServer(cfg_b, engines[1], reg_b, "rb")}

    async def reports():
        for s in servers.values():
            await s.stats.read()
        return {rid: s.report() for rid, s in servers.items()}

    async def send(rid: str, version: int, n: int) -> list[str]:
        rec = reg.get("split").versions[version]
        ends = []
        for i in range(n):
            req = GenerateRequest(f"{rid}-{version}-{i}", f"split@{version}", GREEDY, prompt=f"def f{i}(x):",
                                  adapter_record=rec)
            chunks = [c async for c in servers[rid].generate(req)]
            ends.append(chunks[-1]["type"] if chunks[-1]["type"] != "error" else chunks[-1]["code"])
        return ends

    async def scenario():
        for s in servers.values():
            await s.start()
        runner = RolloutRunner(reg, reports, GoldenClient(LocalLLM(servers["ra"])).answer)
        reg.start_rollout("split", 2, POLICY, actor="test")
        await runner.scan()
        assert await runner.tick() == {"split": "step 0"}
        served = {"ra": await send("ra", 2, 4), "rb": await send("rb", 2, 3)}
        await send("ra", 1, 3)
        await send("rb", 1, 3)
        alone = (await reports())["ra"]
        rollout = reg.get("split").rollout
        a_only = judge(rollout.policy.thresholds, window({"ra": alone}, rollout.baseline, "split@2"),
                       window({"ra": alone}, rollout.baseline, "split@1"))
        done = await runner.tick()
        for s in servers.values():
            await s.stop()
        return served, a_only, done

    try:
        served, a_only, done = asyncio.run(scenario())
    finally:
        for e in engines:
            e.shutdown()
        reg_b.close()
    assert served == {"ra": ["end"] * 4, "rb": ["adapter_load_failed"] * 3}
    assert a_only and all(c.passed for c in a_only)  # replica A's share alone: a healthy canary
    assert done == {"split": "rolled_back"}
    state = reg.get("split")
    assert state.active_version == 1 and state.canary_version is None
    decided = state.rollout.steps[-1]
    assert decided.verdict == "failed" and decided.canary["per_replica_requests"] == {"ra": 4, "rb": 3}
    assert decided.canary["errors"] == 3 and "error_rate" in state.rollout.reason
    entry = reg.audit("split", limit=1, newest_first=True)[0]
    assert entry.action == "rollout_rollback" and entry.actor == "canary-controller"
    assert entry.details["result"]["stable"]["per_replica_requests"] == {"ra": 3, "rb": 3}
