"""Automatic rollouts through the real Serve app (the session's app: local Ray cluster, the quick toy demo model,
2 LLM replicas, its CanaryController), traffic from the official `openai` client.

The versions of one adapter are built here from a demo adapter: v2 is it "retrained" (its B matrices scaled by
1.0001: other files, the same greedy answers), v3 and v4 have their B matrices scaled up 300-fold until they
emit noise; v3 carries golden prompts (the stable version's exact answers), v4 none, so that only its metrics can
catch it (the base model's drafts stop being accepted: the behavioural fingerprint).

The toy model, on the session's app, for the walk's many cases in seconds; test_serve_rollouts_smollm2.py rolls
out real adapter versions on SmolLM2 (a second app, minutes of decoding)."""

from __future__ import annotations

import shutil
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.deployments.serve_harness import ADMIN, APP_NAME, LOAD_KEY
from tests.deployments.rollout_kit import rollout_calls

NAME = "roll"
PROMPTS = ["def add(a, b):", "import os\n", "class Foo:", "for i in range(10):"]
AUTH = {"Authorization": f"Bearer {ADMIN}"}
# Small windows (a test's traffic), loose latency bounds (two shared cores), everything else the defaults.
POLICY = {"window_requests": 4, "window_s": 0, "min_stable_requests": 4, "step_timeout_s": 240,
          "thresholds": {"min_drafted_tokens": 8, "ttft_p50_ratio": 4, "ttft_p99_ratio": 8, "tpot_p50_ratio": 4,
                         "tpot_p99_ratio": 8, "latency_slack_s": 0.5}}
_status, _start, _wait, _audit = rollout_calls(NAME, AUTH, POLICY, start_timeout_s=120, wait_timeout_s=180)


def _variant(src: Path, dst: Path, scale: float) -> Path:
    """A copy of the adapter `src` with every lora_B matrix multiplied by `scale`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = dst / "adapter_model.safetensors"
    tensors = {k: (v * scale if "lora_B" in k else v).contiguous() for k, v in load_file(weights).items()}
    save_file(tensors, weights, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def rollout_app(serve_app):
    from deployments.bootstrap import sha256_of_dir

    reg, incoming = serve_app.registry, serve_app.root / "incoming"
    src = Path(serve_app.demo_adapters[sorted(serve_app.demo_adapters)[0]])
    for version, scale in ((1, 1.0), (2, 1.0001), (3, 300.0), (4, 300.0)):
        d = _variant(src, incoming / f"{NAME}-v{version}-{uuid.uuid4().hex[:6]}", scale)
        reg.register(NAME, str(d), sha256_of_dir(d), serve_app.base_name, actor="test", activate=version == 1)
    import openai

    client = openai.OpenAI(base_url=f"{serve_app.base_url}/v1", api_key=LOAD_KEY, max_retries=0)
    model = f"{serve_app.base_name}:{NAME}"
    stable = {p: client.completions.create(model=model, prompt=p, max_tokens=8, temperature=0).choices[0].text
              for p in PROMPTS[:2]}
    golden = [{"prompt": p, "max_tokens": 8, "exact": text} for p, text in stable.items()]
    for version in (2, 3):
        r = httpx.put(f"{serve_app.base_url}/admin/v1/adapters/{NAME}/versions/{version}/golden", headers=AUTH,
                      json={"prompts": golden})
        assert r.status_code == 200, r.text
    return serve_app, client, model






class Traffic:
    """Completions for the adapter from 3 client threads until stopped."""

    def __init__(self, client, model):
        self.client, self.model, self.sent, self.failed = client, model, 0, 0
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(3)

    def _one(self, i: int) -> None:
        while not self._stop.is_set():
            try:
                self.client.completions.create(model=self.model, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=8,
                                               temperature=0)
                self.sent += 1
            except Exception:  # noqa: BLE001 - counted; the rollout's windows see the replicas' side
                self.failed += 1

    def __enter__(self):
        for i in range(3):
            self._pool.submit(self._one, i)
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._pool.shutdown(wait=True)






def _controller():
    import ray

    (name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
               if a["name"].startswith(f"SERVE_REPLICA::{APP_NAME}#CanaryController#")]
    return name, ray.get_actor(name, namespace="serve")


def test_a_retrained_version_is_promoted_through_every_step_across_a_controller_restart(rollout_app):
    import ray

    app, client, model = rollout_app
    base = app.base_url
    _start(base, 2, steps=[0.3, 0.6])
    first = _wait(base, lambda s: s["rollout"]["phase"] == "running")  # golden prompts passed, no traffic yet
    assert first["rollout"]["step"] == 0 and first["canary_weight"] == 0.3
    killed, actor = _controller()
    ray.kill(actor, no_restart=True)  # the control process dies mid-rollout; Serve starts another
    with Traffic(client, model) as traffic:
        done = _wait(base, lambda s: s["rollout"]["phase"] != "running")
    assert done["rollout"]["phase"] == "promoted", done["rollout"]["reason"]
    assert done["active_version"] == 2 and done["canary_version"] is None and traffic.failed == 0
    assert _controller()[0] != killed  # a new controller finished it
    entries = [e for e in _audit(base) if e["action"].startswith("rollout_")]
    assert [e["action"] for e in entries] == ["rollout_start", "rollout_step", "rollout_step", "rollout_promote"]
    assert [e["details"].get("step") for e in entries[1:3]] == [0, 1]  # none skipped, none twice
    assert [s["step"] for s in done["rollout"]["steps"]] == [-1, 0, 1]
    for step in done["rollout"]["steps"][1:]:  # each window judged on what the replicas counted
        canary = step["canary"]
        assert canary["requests"] >= 4 and sum(canary["per_replica_requests"].values()) == canary["requests"]
        assert step["stable"]["requests"] >= 4 and all(c["passed"] for c in step["checks"])
        assert {"error_rate", "ttft_p50_s", "output_length_max", "finish_reason_shift"} <= {
            c["name"] for c in step["checks"]}
        assert all(g["passed"] for g in step["golden"])
    series = f'loraserve_rollout_phase{{adapter="{NAME}",phase="promoted",version="2"}} 1.0'
    deadline = time.monotonic() + 15  # the ingress asks the controller once a period
    while series not in (metrics := httpx.get(f"{base}/metrics").text) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert series in metrics and f'loraserve_rollout_canary_weight{{adapter="{NAME}",version="2"}} 0.0' in metrics


def test_a_version_failing_its_golden_prompts_gets_no_traffic(rollout_app):
    app, client, model = rollout_app
    base = app.base_url
    _start(base, 3, steps=[0.3, 0.6])
    done = _wait(base, lambda s: s["rollout"]["phase"] != "pending")
    assert done["rollout"]["phase"] == "rolled_back" and done["active_version"] == 2
    rollback = _audit(base)[-1]
    assert rollback["action"] == "rollout_rollback" and rollback["details"]["reason"].startswith("golden prompts failed")
    assert rollback["details"]["result"]["step"] == -1
    started = max(i for i, e in enumerate(_audit(base)) if e["action"] == "rollout_start")
    assert all(e["after"]["canary_weight"] == 0.0 for e in _audit(base)[started:])


def test_a_noisy_version_is_rolled_back_on_its_metrics_within_one_window(rollout_app):
    app, client, model = rollout_app
    base = app.base_url
    # The window waits for drafts of both versions (require_draft_acceptance): on a CPU the gate drafts little (plain
    # steps cost less, more so under load), and a noisy version's drafts, rejected, soon stop; its acceptance (about
    # 0.1 against 1) is plain from 4
    _start(base, 4, steps=[0.5, 0.8], window_requests=10,
           thresholds={**POLICY["thresholds"], "min_drafted_tokens": 4, "require_draft_acceptance": True})
    _wait(base, lambda s: s["rollout"]["phase"] == "running")
    with Traffic(client, model):
        done = _wait(base, lambda s: s["rollout"]["phase"] != "running")
    assert done["rollout"]["phase"] == "rolled_back" and done["active_version"] == 2
    last = done["rollout"]["steps"][-1]
    assert last["step"] == 0 and last["verdict"] == "failed"  # the first window decided it
    failed = {c["name"] for c in last["checks"] if not c["passed"]}
    assert "draft_acceptance_min" in failed, last
    assert done["rollout"]["reason"].startswith("metrics failed") and "draft_acceptance_min" in done["rollout"]["reason"]
    assert _audit(base)[-1]["details"]["reason"] == done["rollout"]["reason"]
