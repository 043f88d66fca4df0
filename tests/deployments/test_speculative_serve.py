"""Speculative LoRA-off drafting through the real Serve app, with the official `openai` client.

The same app twice in sequence (2 LLM replicas each): the default config (speculation on, the gate
deciding; the demo built with the quick recipe so the test takes minutes, not the full demo's training),
then the same with `engine.speculative=null` (plain multi-LoRA). Greedy outputs of 24 requests over 3
adapters and the base model, chat and completions, streamed and not, must be the same; 8 identical seeded
requests at temperature 0.8 to each adapter must give one output per adapter, the same in both apps; and the
default app's /metrics must show per-adapter speculative counters above zero after the traffic.
"""

from __future__ import annotations

import concurrent.futures as cf
import re
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest

from deployments.config import DEFAULT_API_KEY

pytestmark = pytest.mark.slow
PROMPTS = ["def add(a, b):", "import os\n", "The quick brown"]


def serve_base_url() -> str:
    """The session's Serve (the shared app's cluster) if it runs, else a new local one."""
    import ray
    from ray import serve

    from tests.deployments import serve_harness

    shared = serve_harness._state.get("app")  # noqa: SLF001
    if shared is not None:
        return shared.base_url
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = serve_harness._free_port()  # noqa: SLF001
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return f"http://127.0.0.1:{port}"


def start_app(base: str, name: str, root: Path, **args):
    """Start the app (default config but the quick demo, a registry in `root`, small CPU shares so it fits
    beside the session's shared app) under /<name>; -> (its URL, config)."""
    from ray import serve

    from deployments.application import bind_app
    from deployments.bootstrap import bootstrap
    from deployments.config import load_config

    registry = {"registry_db": str(root / "r.db"), "blob_dir": str(root / "blobs"),
                "materialize_dir": str(root / "mat"), "poll_interval_s": 0.2}
    cfg = bootstrap(load_config({"demo_recipe": "quick", "registry": registry, "num_cpus_per_replica": 0.1,
                                 "ingress_num_cpus": 0.1, **args}, env={}))
    serve.run(bind_app(cfg), name=name, route_prefix=f"/{name}")
    return f"{base}/{name}", cfg


def requests(base_name: str, adapters: list[str]) -> list[tuple[str, str, bool, bool]]:
    """(model, prompt, chat, stream): 4 models x 3 prompts x (streamed, not), chat and completions alternating."""
    out = []
    for model in [base_name, *adapters]:
        for j, prompt in enumerate(PROMPTS):
            for stream in (False, True):
                out.append((model, prompt, (j + stream) % 2 == 0, stream))
    return out


def ask(client: openai.OpenAI, model: str, prompt: str, chat: bool, stream: bool) -> str:
    kw = dict(model=model, max_tokens=24, temperature=0, stream=stream)
    if chat:
        r = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw)
        if stream:
            return "".join(c.choices[0].delta.content or "" for c in r if c.choices)
        return r.choices[0].message.content
    r = client.completions.create(prompt=prompt, **kw)
    if stream:
        return "".join(c.choices[0].text for c in r if c.choices)
    return r.choices[0].text


SEEDED = dict(prompt="def __init__(self", max_tokens=24, temperature=0.8, seed=1234)


def run_seeded(url: str, adapters: list[str]) -> dict[str, list[str]]:
    """Per adapter: 8 identical seeded requests, and one more with another seed (last), sent concurrently with the
    other adapters' (each lands in batches of its own mix)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key=DEFAULT_API_KEY, max_retries=0, timeout=120)
    jobs = [(a, SEEDED | {"seed": 1234 if i < 8 else 4321}) for i in range(9) for a in adapters]
    with cf.ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda job: client.completions.create(model=job[0], **job[1]).choices[0].text, jobs))
    out: dict[str, list[str]] = {}
    for (adapter, _), text in zip(jobs, texts):
        out.setdefault(adapter, []).append(text)
    return out


def run_all(url: str, reqs) -> list[str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key=DEFAULT_API_KEY, max_retries=0, timeout=120)
    with cf.ThreadPoolExecutor(4) as pool:  # concurrent: batches mix adapters and the base model
        return list(pool.map(lambda r: ask(client, *r), reqs))


def metric_values(text: str, name: str) -> dict[tuple[str, str], float]:
    """(replica, adapter) -> value of every sample of `name`."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("} ")[0]))
            out[(labels.get("replica"), labels.get("adapter"))] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.fixture(scope="module")
def served():
    """Both apps' outputs for the same requests, and the default app's /metrics after its traffic."""
    from ray import serve

    from deployments.bootstrap import demo_paths

    import ray

    owns = not ray.is_initialized()  # else the session's shared cluster: leave it running
    root = Path(tempfile.mkdtemp(prefix="loraserve-spec-"))
    out: dict = {}
    try:
        base = serve_base_url()
        for name, args in (("spec-on", {}), ("spec-off", {"engine": {"speculative": None}})):
            t0 = time.monotonic()
            url, cfg = start_app(base, name, root / name, **args)
            try:
                adapters = sorted(demo_paths(cfg)["adapters"])[:3]
                reqs = requests(cfg.base_model_name, adapters)
                out[name] = {"engine": cfg.engine, "reqs": reqs, "texts": run_all(url, reqs), "adapters": adapters,
                             "seeded": run_seeded(url, sorted(demo_paths(cfg)["adapters"]))}
                if name == "spec-on":  # replicas report on a timer: wait for the counters, then stop
                    deadline = time.monotonic() + 30
                    while True:
                        text = httpx.get(url + "/metrics", timeout=10).text
                        drafted = metric_values(text, "loraserve_spec_drafted_tokens_total")
                        got = {a.split("@")[0] for (_, a), v in drafted.items() if v > 0}
                        if set(adapters) <= got or time.monotonic() > deadline:
                            break
                        time.sleep(1)
                    out[name]["metrics"] = text
            finally:
                serve.delete(name)
            out[name]["seconds"] = time.monotonic() - t0
        yield out
    finally:
        if owns and ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)


def test_greedy_outputs_with_speculation_equal_plain_decoding(served):
    on, off = served["spec-on"], served["spec-off"]
    assert on["engine"]["speculative"] == {"num_draft_tokens": 4, "gate": True, "min_acceptance": 0.3,
                                           "acceptance_ema": 0.1, "initial_acceptance": 0.8,
                                           "draft_lead": 1}
    assert off["engine"]["speculative"] is None
    reqs = on["reqs"]
    assert len(reqs) >= 20 and len({m for m, *_ in reqs}) == 4 and {s for *_, s in reqs} == {True, False}
    diffs = [(r, a, b) for r, a, b in zip(reqs, on["texts"], off["texts"]) if a != b]
    assert not diffs, f"{len(diffs)} of {len(reqs)} differ, first: {diffs[0]}"
    assert sum(bool(t) for t in on["texts"]) >= len(reqs) - 2  # they generated something


def test_seeded_sampling_gives_one_output_whatever_the_batch_and_speculation(served):
    """Seeded sampling draws each token with noise keyed by (seed, position) alone, and speculation commits
    exactly the target's draws: 8 identical requests give one text, with speculation on and off alike."""
    on, off = served["spec-on"]["seeded"], served["spec-off"]["seeded"]
    assert on.keys() == off.keys() and len(on) >= 3
    for adapter, texts in on.items():
        assert len(set(texts[:8])) == 1, (adapter, texts[:8])
        assert texts[:8] == off[adapter][:8], (adapter, texts[0], off[adapter][0])
    assert any(texts[8] != texts[0] for texts in on.values())  # another seed, another draw: it does sample


def test_default_app_exports_per_adapter_speculative_counters(served):
    text = served["spec-on"]["metrics"]
    drafted = metric_values(text, "loraserve_spec_drafted_tokens_total")
    accepted = metric_values(text, "loraserve_spec_accepted_tokens_total")
    rate = metric_values(text, "loraserve_spec_acceptance_rate")
    for adapter in served["spec-on"]["adapters"]:
        mine = [k for k in drafted if k[1].split("@")[0] == adapter]
        assert sum(drafted[k] for k in mine) > 0, (adapter, drafted)
        assert sum(accepted.get(k, 0) for k in mine) > 0 and any(rate.get(k, 0) > 0 for k in mine), (adapter, rate)
    cycles = metric_values(text, "loraserve_spec_cycles_total")
    assert sum(cycles.values()) > 0
    assert "loraserve_spec_gate_decisions_total{" in text
