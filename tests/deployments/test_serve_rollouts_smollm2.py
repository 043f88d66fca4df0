"""Automatic rollouts of a real adapter through the real Serve app: SmolLM2-135M-Instruct and its `shout` adapter
(answers in capital letters), traffic from the official `openai` client's chat completions.

The versions of `shout`: v1 the committed adapter; v2 it retrained with another seed (tests/fixtures/
smollm2_shout_retrained: other weights, the same behaviour); v3 the committed `json` adapter's weights (answers
`{"answer": ...}`: a version trained to the wrong behaviour); v4 v1 with its B matrices scaled 40-fold, which
answers every question with one word repeated ("aughteredaughtered..."). v2 and v3 carry a golden prompt (a held-out
question, its answer shouted); v4 none, so that only its metrics can catch it. Requests stop at 12 tokens,
where the stable version's answers are cut too: finish reasons and lengths then look alike, and what tells v4
apart is the base model's draft acceptance, which its loop raises (about 0.7 -> 1.0).

The app drafts at every step (the speculation gate off), as the gate does where drafting pays: on two CPU cores with
several requests at a time it prices plain steps cheaper and drafts nothing, and a window without drafts has no
acceptance to compare (its step result then lists the check under `not_compared`).

Its own app (one LLM replica) beside the session's toy app, on the same Ray cluster when one runs."""

from __future__ import annotations

import hashlib
import itertools
import json
import shutil
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from registry.canary_analysis import CHECKS
from tests.deployments import serve_harness
from tests.deployments.rollout_kit import rollout_calls

pytestmark = pytest.mark.slow

APP, PREFIX = "rollouts-smollm2", "/smollm2"
KEY, ADMIN = "sk-rollout-smollm2-1", "rollout-smollm2-admin"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
NAME = "shout"
RETRAINED = Path(__file__).resolve().parents[1] / "fixtures" / "smollm2_shout_retrained"
MAX_TOKENS = 12
SHOUTED = r"^[^a-z]*[A-Z]{2}[^a-z]*$"  # capitals, and no lower-case letter anywhere
# Windows of 12 requests a version (about 150 drafted tokens each; with 4, which questions a window happened to get
# moved acceptance by 0.2), loose latency bounds (two shared cores), the other thresholds the defaults.
WINDOW = 12
POLICY = {"steps": [0.5, 0.6], "window_requests": WINDOW, "window_s": 0, "min_stable_requests": WINDOW,
          "step_timeout_s": 300,
          "thresholds": {"ttft_p50_ratio": 4, "ttft_p99_ratio": 8, "tpot_p50_ratio": 4, "tpot_p99_ratio": 8,
                         "latency_slack_s": 1.0}}
_status, _start, _wait, _audit = rollout_calls(NAME, AUTH, POLICY, start_timeout_s=300, wait_timeout_s=300)
THREADS = 8


def _questions() -> list[str]:
    from demo.smollm2.data import conversations

    return [user for user, _ in conversations("shout", "heldout", seed=1234)[:4]]


def _scaled(src: Path, dst: Path, scale: float) -> Path:
    """A copy of the adapter `src` with every lora_B matrix multiplied by `scale`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = dst / "adapter_model.safetensors"
    tensors = {k: ((v.float() * scale).to(v.dtype) if "lora_B" in k else v).contiguous()
               for k, v in load_file(weights).items()}
    save_file(tensors, weights, metadata={"format": "pt"})
    return dst


def _check_sums(d: Path) -> None:
    for line in (d / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split()
        assert hashlib.sha256((d / name).read_bytes()).hexdigest() == digest, f"{d / name} changed"


@pytest.fixture(scope="module")
def app():
    from deployments.bootstrap import bootstrap, demo_paths, make_registry, sha256_of_dir
    from deployments.config import load_config

    root = Path(tempfile.mkdtemp(prefix="loraserve-rollouts-smollm2-"))
    incoming = root / "incoming"
    incoming.mkdir()
    args = {
        "demo_recipe": "smollm2", "register_demo_adapters": False, "num_replicas": 1, "num_cpus_per_replica": 0.1,
        "ingress_num_cpus": 0.1, "routing_stats_period_s": 0.5, "canary": {"period_s": 0.5},
        "engine": {"speculative": {"gate": False}}, "api_keys": {KEY: "rollouts"}, "admin_token": ADMIN,
        "tenant_rates": {"rollouts": {"rate": 1e6, "burst": 1e6}},
        "registry": {"registry_db": str(root / "registry.db"), "blob_dir": str(root / "blobs"),
                     "materialize_dir": str(root / "materialized"), "allowed_local_roots": [str(incoming)],
                     "poll_interval_s": 0.2},
    }
    cfg = bootstrap(load_config(args, env={}))
    committed = demo_paths(cfg)["adapters"]
    _check_sums(RETRAINED)
    reg = make_registry(cfg)
    versions = {1: shutil.copytree(committed["shout"], incoming / "v1"),
                2: shutil.copytree(RETRAINED, incoming / "v2", ignore=shutil.ignore_patterns("SHA256SUMS")),
                3: shutil.copytree(committed["json"], incoming / "v3"),
                4: _scaled(Path(committed["shout"]), incoming / "v4", 40.0)}
    for version, d in versions.items():
        reg.register(NAME, str(d), sha256_of_dir(Path(d)), cfg.base_model_name, actor="test", activate=version == 1)
    golden = [{"messages": [{"role": "user", "content": _questions()[0]}], "max_tokens": 8, "regex": SHOUTED}]
    try:
        with serve_harness.deployed(cfg, APP, PREFIX) as url:
            import openai

            for version in (2, 3):
                r = httpx.put(f"{url}/admin/v1/adapters/{NAME}/versions/{version}/golden", headers=AUTH,
                              json={"prompts": golden})
                assert r.status_code == 200, r.text

            client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
            yield url, client, f"{cfg.base_model_name}:{NAME}"
    finally:
        reg.close()
        shutil.rmtree(root, ignore_errors=True)


class Traffic:
    """Chat completions for the adapter from THREADS client threads until stopped, the held-out questions in turn."""

    def __init__(self, client, model):
        self.client, self.model, self.failed = client, model, 0
        self.served: dict[str, int] = {}  # adapter version (x-loraserve-adapter) -> requests
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(THREADS)
        self._questions, self._turn = _questions(), itertools.count()

    def _one(self) -> None:
        while not self._stop.is_set():
            question = self._questions[next(self._turn) % len(self._questions)]
            try:
                raw = self.client.chat.completions.with_raw_response.create(
                    model=self.model, max_tokens=MAX_TOKENS, temperature=0,
                    messages=[{"role": "user", "content": question}])
                version = raw.headers["x-loraserve-adapter"]
                self.served[version] = self.served.get(version, 0) + 1
            except Exception:  # noqa: BLE001 - counted; the rollout's windows see the replicas' side
                self.failed += 1

    def __enter__(self):
        for _ in range(THREADS):
            self._pool.submit(self._one)
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._pool.shutdown(wait=True)










def _rollout_entries(url: str) -> list[dict]:
    """The audit entries of the latest rollout, from its start."""
    entries = [e for e in _audit(url) if e["action"].startswith("rollout_")]
    start = max(i for i, e in enumerate(entries) if e["action"] == "rollout_start")
    return entries[start:]


def test_a_retrained_shout_is_promoted_through_every_step(app):
    url, client, model = app
    _start(url, 2)
    _wait(url, lambda s: s["rollout"]["phase"] != "pending")  # its golden prompts passed: step 0, no traffic yet
    with Traffic(client, model) as traffic:
        done = _wait(url, lambda s: s["rollout"]["phase"] != "running")
    assert done["rollout"]["phase"] == "promoted", json.dumps(done["rollout"]["steps"])
    assert done["active_version"] == 2 and done["canary_version"] is None and traffic.failed == 0
    assert traffic.served.get(f"{NAME}@2") and traffic.served.get(f"{NAME}@1")  # both versions served the client
    assert [e["action"] for e in _rollout_entries(url)] == ["rollout_start", "rollout_step", "rollout_step",
                                                            "rollout_promote"]
    assert [s["step"] for s in done["rollout"]["steps"]] == [-1, 0, 1]
    for step in done["rollout"]["steps"][1:]:
        assert step["canary"]["requests"] >= WINDOW and step["stable"]["requests"] >= WINDOW
        # every check applied (the fingerprint in both directions), and every one passed
        assert not step["not_compared"] and {c["name"] for c in step["checks"]} == set(CHECKS), step
        assert all(c["passed"] for c in step["checks"]) and all(g["passed"] for g in step["golden"])


def test_a_version_that_answers_in_json_is_rolled_back_on_its_golden_prompts_before_any_traffic(app):
    url, client, model = app
    _start(url, 3)
    done = _wait(url, lambda s: s["rollout"]["phase"] != "pending")
    assert done["rollout"]["phase"] == "rolled_back" and done["active_version"] == 2
    entries = _rollout_entries(url)
    assert [e["action"] for e in entries] == ["rollout_start", "rollout_rollback"]
    reason = entries[-1]["details"]["reason"]
    assert reason.startswith("golden prompts failed") and '{"answer"' in reason, reason
    assert entries[-1]["details"]["result"]["step"] == -1
    assert all(e["after"]["canary_weight"] == 0.0 for e in entries)


def test_shout_scaled_into_a_loop_is_rolled_back_on_its_draft_acceptance_within_one_window(app):
    url, client, model = app
    _start(url, 4, window_requests=6, min_stable_requests=6)  # its loop stands 0.25-0.3 clear of the stable's
    _wait(url, lambda s: s["rollout"]["phase"] != "pending")
    with Traffic(client, model) as traffic:
        done = _wait(url, lambda s: s["rollout"]["phase"] != "running")
    assert done["rollout"]["phase"] == "rolled_back" and done["active_version"] == 2, json.dumps(done["rollout"])
    assert traffic.served.get(f"{NAME}@4")  # it did serve the client before it was judged
    last = done["rollout"]["steps"][-1]
    assert last["step"] == 0 and last["verdict"] == "failed"  # the first window decided it
    checks = {c["name"]: c for c in last["checks"]}
    assert not checks["draft_acceptance_max"]["passed"] and not last["not_compared"], last
    assert checks["draft_acceptance_max"]["canary"] > checks["draft_acceptance_max"]["stable"]
    entries = _rollout_entries(url)
    assert [e["action"] for e in entries] == ["rollout_start", "rollout_step", "rollout_rollback"]
    reason = entries[-1]["details"]["reason"]
    assert reason == done["rollout"]["reason"] and reason.startswith("metrics failed")
    assert "draft_acceptance_max" in reason, reason
