"""Automatic rollouts on the control plane, on both store pairs (SQLite + local dir, real Redis + real S3): the REST
routes refuse bad input with nothing changed, and the rollout controller (registry.canary_runner) steps, promotes
and rolls back on the counters of several replicas. The replicas' reports come from the replicas' own recorder
(VersionStats) fed by simulated requests, and golden answers from a table: these two neighbours are faked here to
isolate the control plane; tests/deployments/test_serve_rollouts.py runs the same through the served app."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient

from deployments.replica.version_stats import VersionStats
from registry.api import create_app
from registry.canary_runner import RolloutRunner, run_golden
from registry.errors import LifecycleConflict
from tests.registry.adapter_kit import BASE, sha_map
from tests.registry.test_canary_analysis import Clock, report, serve

TOKENS = {"adm": {"role": "admin", "name": "root"}}
AUTH = {"Authorization": "Bearer adm"}
FAST = {"steps": [0.2, 0.5], "window_requests": 5, "window_s": 0, "min_stable_requests": 5,
        "thresholds": {"min_drafted_tokens": 8}}


class Fleet:
    """Replicas as the controller sees them: replica id -> recorder, plus the engine's draft counters."""

    def __init__(self, *ids: str):
        self.clock = Clock()
        self.stats = {rid: VersionStats(self.clock) for rid in ids}
        self.drafts: dict[str, dict[str, tuple[int, int]]] = {rid: {} for rid in ids}

    def traffic(self, rid: str, key: str, n: int, accept: float = 0.9, **kw) -> None:
        serve(self.stats[rid], self.clock, key, n, **kw)
        d, a = self.drafts[rid].get(key, (0, 0))
        self.drafts[rid][key] = (d + 8 * n, a + round(8 * n * accept))

    async def reports(self) -> dict:
        return {rid: report(st, self.drafts[rid]) for rid, st in self.stats.items()}


class Answers:
    """Golden answers by version (the data plane faked): version -> text."""

    def __init__(self, by_version: dict[int, str]):
        self.by_version = by_version

    async def generate(self, record, golden) -> str:
        return self.by_version[record.version]

    def check(self, record, prompts) -> list[dict]:
        return asyncio.run(run_golden(self.generate, record, prompts))


@pytest.fixture
def setup(make_registry, backend, stage):
    reg = make_registry(backend)
    for template in ("a", "a", "b"):  # v1 active, v2 the same weights retrained, v3 other weights
        src = stage(template)
        reg.register("ad", str(src), sha_map(src), BASE, actor="test")
    reg.promote("ad", 1, actor="test")
    answers = Answers({1: "HELLO", 2: "HELLO", 3: "hello"})
    client = TestClient(create_app(reg, TOKENS, golden=answers.check))
    return reg, client, answers


def _run(runner: RolloutRunner) -> dict:
    return asyncio.run(runner.tick())


def _actions(reg, name="ad") -> list[str]:
    return [e.action for e in reg.audit(name, limit=1000)]


def test_a_rollout_steps_through_every_window_then_promotes(setup):
    reg, client, answers = setup
    client.put("/v1/adapters/ad/versions/2/golden", headers=AUTH,
               json={"prompts": [{"prompt": "hi", "exact": "HELLO"}]}).raise_for_status()
    r = client.post("/v1/adapters/ad/rollout", headers=AUTH, json={"version": 2, "policy": FAST})
    assert r.status_code == 201, r.text
    assert r.json()["rollout"]["phase"] == "pending" and r.json()["canary_weight"] == 0.0
    fleet = Fleet("r1", "r2")
    runner = RolloutRunner(reg, fleet.reports, answers.generate, clock=fleet.clock)
    asyncio.run(runner.scan())
    assert _run(runner) == {"ad": "step 0"}
    assert reg.get("ad").canary_weight == 0.2 and reg.get("ad").canary_version == 2
    assert _run(runner) == {}  # the window is empty
    fleet.traffic("r1", "ad@2", 3)
    fleet.traffic("r2", "ad@2", 2)
    fleet.traffic("r1", "ad@1", 10)
    assert _run(runner) == {"ad": "step 1"} and reg.get("ad").canary_weight == 0.5
    fleet.traffic("r2", "ad@2", 6)
    fleet.traffic("r1", "ad@1", 6)
    status = client.get("/v1/adapters/ad/rollout", headers=AUTH).json()
    assert status["rollout"]["step"] == 1 and [s["verdict"] for s in status["rollout"]["steps"]] == ["passed"] * 2
    assert _run(runner) == {"ad": "promoted"}
    state = reg.get("ad")
    assert state.active_version == 2 and state.canary_version is None and state.history == [1]
    assert state.rollout.phase == "promoted"
    entries = {e.action: e for e in reg.audit("ad", limit=1000)}
    assert _actions(reg)[-4:] == ["rollout_start", "rollout_step", "rollout_step", "rollout_promote"]
    decided = entries["rollout_promote"].details["result"]
    assert decided["canary"]["requests"] == 6 and decided["stable"]["requests"] == 6
    assert {c["name"] for c in decided["checks"]} >= {"error_rate", "ttft_p50_s", "draft_acceptance_min"}
    assert all(c["passed"] for c in decided["checks"]) and decided["golden"][0]["passed"]


def test_a_regression_on_one_replicas_share_rolls_back(setup):
    reg, client, answers = setup
    client.post("/v1/adapters/ad/rollout", headers=AUTH, json={"version": 3, "policy": FAST}).raise_for_status()
    fleet = Fleet("r1", "r2")
    runner = RolloutRunner(reg, fleet.reports, answers.generate, clock=fleet.clock)
    asyncio.run(runner.scan())
    _run(runner)
    fleet.traffic("r1", "ad@3", 4)  # fine on r1
    fleet.traffic("r2", "ad@3", 2, status=500)  # failing on r2: a third of the canary's window
    fleet.traffic("r1", "ad@1", 5)
    fleet.traffic("r2", "ad@1", 5)
    assert _run(runner) == {"ad": "rolled_back"}
    state = reg.get("ad")
    assert state.active_version == 1 and state.canary_version is None and state.canary_weight == 0.0
    entry = reg.audit("ad", limit=1, newest_first=True)[0]
    assert entry.action == "rollout_rollback" and "error_rate" in entry.details["reason"]
    assert entry.details["result"]["canary"]["per_replica_requests"] == {"r1": 4, "r2": 2}
    assert state.rollout.steps[-1].verdict == "failed"


REQUIRED = {**FAST, "step_timeout_s": 100, "thresholds": {"min_drafted_tokens": 8, "require_draft_acceptance": True}}


@pytest.mark.parametrize("drafts", ["arrive", "never"])
def test_a_rollout_that_requires_the_acceptance_waits_for_drafts(setup, drafts):
    """A canary whose window is full of requests but drafted nothing (the gate ran plain steps) is not judged yet;
    its drafts, once they come, decide it (here mostly rejected: rolled back on the acceptance); if they never
    come, the step times out and says why."""
    reg, client, answers = setup
    client.post("/v1/adapters/ad/rollout", headers=AUTH, json={"version": 3, "policy": REQUIRED}).raise_for_status()
    fleet = Fleet("r1")
    runner = RolloutRunner(reg, fleet.reports, answers.generate, clock=fleet.clock)
    asyncio.run(runner.scan())
    assert _run(runner) == {"ad": "step 0"}
    serve(fleet.stats["r1"], fleet.clock, "ad@3", 6)  # requests, no drafts
    fleet.traffic("r1", "ad@1", 10)
    assert _run(runner) == {} and reg.get("ad").canary_version == 3  # still open
    if drafts == "arrive":
        fleet.traffic("r1", "ad@3", 1, accept=0.1)
    else:
        fleet.clock.t += 101
    assert _run(runner) == {"ad": "rolled_back"}
    reason = reg.audit("ad", limit=1, newest_first=True)[0].details["reason"]
    if drafts == "arrive":
        assert "draft_acceptance_min" in reason and reg.get("ad").rollout.steps[-1].verdict == "failed"
    else:
        assert "0 and 80 drafted tokens (each needs 8)" in reason, reason


def test_golden_prompts_that_fail_on_the_canary_give_it_no_traffic(setup):
    reg, client, answers = setup
    client.put("/v1/adapters/ad/versions/3/golden", headers=AUTH,
               json={"prompts": [{"prompt": "hi", "regex": "^HELLO$"}]}).raise_for_status()
    client.post("/v1/adapters/ad/rollout", headers=AUTH, json={"version": 3, "policy": FAST}).raise_for_status()
    fleet = Fleet("r1")
    runner = RolloutRunner(reg, fleet.reports, answers.generate, clock=fleet.clock)
    asyncio.run(runner.scan())
    assert _run(runner) == {"ad": "rolled_back"}
    entries = reg.audit("ad", limit=1000)
    assert all((e.after or {}).get("canary_weight", 0.0) == 0.0 for e in entries)
    assert "golden prompts failed" in entries[-1].details["reason"] and "'hi'" in entries[-1].details["reason"]


def test_a_restarted_controller_resumes_at_its_step_and_never_promotes_twice(setup):
    reg, client, answers = setup
    client.post("/v1/adapters/ad/rollout", headers=AUTH, json={"version": 2, "policy": FAST}).raise_for_status()
    fleet = Fleet("r1")
    first = RolloutRunner(reg, fleet.reports, answers.generate, clock=fleet.clock)
    asyncio.run(first.scan())
    _run(first)  # step 0
    fleet.traffic("r1", "ad@2", 5)
    fleet.traffic("r1", "ad@1", 5)
    stale = reg.get("ad").rollout  # what the first controller read before it died
    again = RolloutRunner(reg, fleet.reports, answers.generate, clock=fleet.clock)  # the restarted one
    asyncio.run(again.scan())
    assert again.names == {"ad"} and _run(again) == {"ad": "step 1"}
    with pytest.raises(LifecycleConflict):  # the dead one's decision, taken at step 0, is refused
        reg.advance_rollout("ad", "rollout_step", {"id": stale.id, "from_step": 0, "step": 1, "started_at": 0,
                                                   "baseline": {}})
    fleet.traffic("r1", "ad@2", 5)
    fleet.traffic("r1", "ad@1", 5)

    async def both():  # two controllers decide on the same window at once
        return await asyncio.gather(first.tick(), again.tick())

    results = asyncio.run(both())
    assert sorted(r.get("ad", "") for r in results) == ["", "promoted"]
    actions = _actions(reg)
    assert actions.count("rollout_promote") == 1 and actions.count("rollout_step") == 2
    assert [s.step for s in reg.get("ad").rollout.steps] == [-1, 0, 1]


def _state_json(reg):
    return reg.get("ad").model_dump(mode="json")


@pytest.mark.parametrize("prepare,body,status,code", [
    (None, {"version": 2, "policy": {"steps": [0.5, 0.1]}}, 422, "invalid_request"),
    (None, {"version": 2, "policy": {"thresholds": {"ttft_p50_ratio": 0.5}}}, 422, "invalid_request"),
    (None, {"version": 2, "policy": {"window_requests": 0, "window_s": 0}}, 422, "invalid_request"),
    (None, {"version": 1}, 409, "conflict"),
    (None, {"version": 9}, 404, "adapter_not_found"),
    ("canary", {"version": 2}, 409, "canary_in_progress"),
    ("rollout", {"version": 3}, 409, "rollout_in_progress"),
    ("golden_stable_fails", {"version": 3}, 422, "golden_fails_on_stable"),
])
def test_bad_rollouts_are_refused_with_nothing_changed(setup, prepare, body, status, code):
    reg, client, answers = setup
    if prepare == "canary":
        reg.canary("ad", 3, 0.1, actor="test")
    elif prepare == "rollout":
        client.post("/v1/adapters/ad/rollout", headers=AUTH, json={"version": 2}).raise_for_status()
    elif prepare == "golden_stable_fails":  # v1 answers HELLO: a golden prompt wanting lower case fails there too
        client.put("/v1/adapters/ad/versions/3/golden", headers=AUTH,
                   json={"prompts": [{"prompt": "hi", "exact": "hello"}]}).raise_for_status()
    before = _state_json(reg)
    r = client.post("/v1/adapters/ad/rollout", headers=AUTH, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code
    assert _state_json(reg) == before
    refusal = reg.audit("ad", limit=1, newest_first=True)[0]
    assert refusal.action == "rollout_start_rejected" and refusal.actor == "root"


def test_golden_prompts_need_a_data_plane_and_hand_made_changes_wait_for_the_rollout(setup, make_registry):
    reg, client, answers = setup
    client.put("/v1/adapters/ad/versions/2/golden", headers=AUTH,
               json={"prompts": [{"prompt": "hi", "exact": "HELLO"}]}).raise_for_status()
    alone = TestClient(create_app(reg, TOKENS))  # a control plane without a data plane to run them on
    r = alone.post("/v1/adapters/ad/rollout", headers=AUTH, json={"version": 2})
    assert r.status_code == 409 and r.json()["error"]["code"] == "golden_unavailable"
    bad = client.put("/v1/adapters/ad/versions/2/golden", headers=AUTH, json={"prompts": [{"prompt": "x", "regex": "("}]})
    assert bad.status_code == 422 and reg.get("ad").versions[2].golden[0].exact == "HELLO"
    client.post("/v1/adapters/ad/rollout", headers=AUTH, json={"version": 2}).raise_for_status()
    for path, payload in (("promote", {"version": 3}), ("canary", {"version": 3, "weight": 0.5}), ("rollback", None)):
        r = client.post(f"/v1/adapters/ad/{path}", headers=AUTH, json=payload)
        assert r.status_code == 409 and r.json()["error"]["code"] == "rollout_in_progress", (path, r.text)
    r = client.put("/v1/adapters/ad/versions/2/golden", headers=AUTH, json={"prompts": []})
    assert r.status_code == 409
    r = client.post("/v1/adapters/ad/rollout/abort", headers=AUTH)
    assert r.status_code == 200 and r.json()["rollout"]["phase"] == "aborted" and r.json()["canary_version"] is None
    assert client.post("/v1/adapters/ad/rollout/abort", headers=AUTH).status_code == 409
