"""The Serve app with `engine.tensor_parallel_size=2` on a local Ray cluster: one LLM replica in a placement group
of two CPU bundles (STRICT_PACK), its engine on two processes (rank 0 the replica's engine core process, one worker
rank it starts),
answering the official `openai` client, chat and completions, streamed and not, on the base model and demo
adapters; its greedy completions are those of a one-rank engine on the same model and adapters."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import openai
import pytest

from deployments.config import DEFAULT_API_KEY
from tests.deployments.test_speculative_serve import requests, run_all, serve_base_url, start_app

pytestmark = pytest.mark.slow
APP = "tp2"


@pytest.fixture(scope="module")
def served():
    import ray
    from ray import serve

    from deployments.bootstrap import demo_paths

    owns = not ray.is_initialized()  # else the session's shared cluster: leave it running
    root = Path(tempfile.mkdtemp(prefix="loraserve-tp-"))
    try:
        base = serve_base_url()
        t0 = time.monotonic()
        url, cfg = start_app(base, APP, root, num_replicas=1, engine={"tensor_parallel_size": 2})
        try:
            adapters = sorted(demo_paths(cfg)["adapters"])[:2]
            reqs = requests(cfg.base_model_name, adapters)
            yield {"url": url, "cfg": cfg, "adapters": adapters, "reqs": reqs, "texts": run_all(url, reqs),
                   "groups": ray.util.placement_group_table(), "workers": rank_processes(APP),
                   "start_s": time.monotonic() - t0}
        finally:
            serve.delete(APP)
    finally:
        if owns and ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)


def rank_processes(app: str) -> list[int]:
    """Pids of the processes the app's LLM replicas' engine cores spawned (their worker ranks): a spawned child's
    command line is multiprocessing's `spawn_main`."""
    import psutil

    from tests.deployments.serve_harness import llm_replicas
    from tests.deployments.test_engine_core_faults import core_pid

    out = []
    for actor in llm_replicas(app).values():
        for child in psutil.Process(core_pid(actor)).children():
            if any("spawn_main" in part for part in child.cmdline()):
                out.append(child.pid)
    return out


def test_the_replica_holds_a_placement_group_of_two_cpu_bundles(served):
    assert served["cfg"].engine["tensor_parallel_size"] == 2
    groups = [g for g in served["groups"].values() if g["state"] == "CREATED" and g["strategy"] == "STRICT_PACK"
              and len(g["bundles"]) == 2]
    assert groups, served["groups"]
    assert all(set(b) == {"CPU"} for b in groups[0]["bundles"].values())
    assert len(served["workers"]) == 1  # the replica's one worker rank, its own process


def test_it_answers_the_openai_client(served):
    reqs, texts = served["reqs"], served["texts"]
    assert len(reqs) == 18 and {s for *_, s in reqs} == {True, False} and len({m for m, *_ in reqs}) == 3
    assert sum(bool(t) for t in texts) >= len(reqs) - 2  # they generated something
    client = openai.OpenAI(base_url=served["url"] + "/v1", api_key=DEFAULT_API_KEY, max_retries=0, timeout=60)
    assert {m.id for m in client.models.list().data} >= set(served["adapters"])


def test_greedy_completions_are_a_one_rank_engines(served):
    """The completions (not chat: no template) of the two-rank replica, against an engine of one rank built here
    with the replica's resolved engine section."""
    from deployments.bootstrap import demo_paths
    from deployments.engine_settings import build_engine_config
    from engine_ext import LLMEngine, SamplingParams

    cfg = served["cfg"]
    paths = demo_paths(cfg)
    engine = LLMEngine(build_engine_config(cfg.engine | {"tensor_parallel_size": 1}, paths["model"]))
    for name in served["adapters"]:
        engine.add_adapter(name, paths["adapters"][name])
    completions = [(r, t) for r, t in zip(served["reqs"], served["texts"]) if not r[2]]
    assert len(completions) >= 6
    params = SamplingParams(max_tokens=24, temperature=0)
    for (model, prompt, _, _), text in completions:
        adapter = None if model == cfg.base_model_name else model
        want = engine.generate(prompts=[prompt], sampling_params=params, adapter_names=[adapter])[0].text
        assert text == want, (model, prompt)
