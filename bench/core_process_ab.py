"""The engine core in a process of its own against on a thread of the replica, through the real served path on the
CPU: one Ray Serve app per mode (`engine.engine_process` true / false; everything else the app's defaults), each
with one LLM replica on the embedded quick demo model (a real trained model of 2 layers, hidden 64: its forward
costs little, so a step is mostly host work, as at the GPU replicas' sizes), and `--concurrency` streaming chat
requests at once through the HTTP ingress with the official `openai` client (AsyncOpenAI). Windows of the modes
alternate within the run, so drift in the machine's load falls on both alike.

Prints one JSON object per window (completion tokens per second over the window, TTFT p50/p99 from sending each
request to its first content chunk, errors), then a summary per mode (medians over windows; TTFT percentiles over
every request of the mode), process against thread, and the load average over the run.

    python bench/core_process_ab.py --concurrency 128 --max-tokens 100 --windows 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {"thread": False, "process": True}
KEY = "sk-bench-core-ab"
PROMPTS = ["Write a function that adds two numbers.", "Explain what a linked list is.",
           "def fibonacci(n):", "List three uses of a hash map.", "How do I reverse a string in Python?"]


def app_config(mode: str, root: Path, args) -> dict:
    return {
        "demo_recipe": "quick",
        "num_replicas": 1,
        "num_cpus_per_replica": 0.5,
        "ingress_num_cpus": 0.25,
        "max_ongoing_requests": 2 * args.concurrency,
        "api_keys": {KEY: "bench"},
        "tenant_rates": {"bench": {"rate": 1e6, "burst": 1e6}},
        "engine": {"engine_process": MODES[mode], "max_num_seqs": args.concurrency},
        "registry": {"registry_db": str(root / mode / "registry.db"), "blob_dir": str(root / mode / "blobs"),
                     "materialize_dir": str(root / mode / "materialized"), "allowed_local_roots": [str(root)]},
    }


def percentile(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3, 1) if xs else None


async def one(client, model: str, i: int, max_tokens: int) -> tuple[float | None, int, str | None]:
    """-> (seconds to the first content chunk, completion tokens, error)."""
    start, first = time.perf_counter(), None
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], max_tokens=max_tokens,
            temperature=1.0, seed=i, stream=True, stream_options={"include_usage": True})
        tokens = 0
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - start
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return first, tokens, None
    except Exception as e:  # noqa: BLE001 - counted, never hidden
        return first, 0, f"{type(e).__name__}: {e}"[:200]


async def window(base_url: str, model: str, args) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=300)
    start = time.perf_counter()
    results = await asyncio.gather(*(one(client, model, i, args.max_tokens) for i in range(args.concurrency)))
    seconds = time.perf_counter() - start
    await client.close()
    ttft = [r[0] for r in results if r[0] is not None]
    tokens = sum(r[1] for r in results)
    return {"tokens": tokens, "tokens_per_s": round(tokens / seconds), "seconds": round(seconds, 2),
            "ttft_ms": ttft, "errors": [r[2] for r in results if r[2]][:3],
            "num_errors": sum(bool(r[2]) for r in results)}


def summary(rows: list[dict], load: tuple[float, float], model: str) -> dict:
    out = {"summary": True, "model": f"{model} (the quick demo: real weights, 2 layers, hidden 64)",
           "load_avg_1m": {"start": load[0], "end": load[1]}}
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        if mine:
            ttft = [t / 1e3 for r in mine for t in r["ttft_all_ms"]]
            out[mode] = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
                         "core_ms_per_step": statistics.median(r["core_ms_per_step"] for r in mine),
                         "ttft_p50_ms": percentile(ttft, 0.5), "ttft_p99_ms": percentile(ttft, 0.99),
                         "errors": sum(r["num_errors"] for r in mine), "windows": len(mine)}
    if "thread" in out and "process" in out:
        out["process_over_thread_tokens_per_s"] = round(out["process"]["tokens_per_s"] /
                                                        out["thread"]["tokens_per_s"], 2)
    return out


def on_replica(app: str, fn):
    """fn(the app's LLMDeployment object), run inside its LLM replica (Serve's private path to it; benchmarks only)."""
    import ray

    names = [n["name"] if isinstance(n, dict) else n for n in ray.util.list_named_actors(all_namespaces=True)]
    name = next(n for n in names if n.startswith(f"SERVE_REPLICA::{app}#LLMServer#"))
    actor = ray.get_actor(name, namespace="serve")
    return ray.get(actor.__ray_call__.remote(lambda replica: fn(replica._replica_impl._user_callable_wrapper
                                                                 .user_callable)), timeout=30)


def core_counters(app: str) -> dict:
    """The replica's engine core loop counters (steps, seconds in step(), seconds publishing)."""
    return on_replica(app, lambda deployment: deployment.server.engine.stats()["core"])


def replica_startup(app: str) -> dict:
    """The start-up of the app's LLM replica: seconds from its constructor to its engine (and its core) ready and
    to ready, the engine's own load seconds, and whether its process (and its core's) was forked warm."""
    m = on_replica(app, lambda deployment: deployment.startup)
    return {"engine_s": round(m["engine_ready"] - m["model_dir_ready"], 2),
            "constructor_to_ready_s": round(m["ready"] - m["constructor"], 2), "engine_load_s": m["engine"]["load_s"],
            "warm_start": m["warm_start"], "engine_core_forked": m.get("engine_core_forked")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=100)
    ap.add_argument("--windows", type=int, default=3, help="measured windows per mode (after one warm-up each)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))

    import ray
    from ray import serve

    from deployments.application import bind_app
    from deployments.bootstrap import bootstrap
    from deployments.config import load_config

    root = Path(tempfile.mkdtemp(prefix="core-ab-"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    model = None
    try:
        for mode in args.modes:
            cfg = bootstrap(load_config(app_config(mode, root, args), env={}))
            model = cfg.base_model_name
            serve.run(bind_app(cfg), name=f"core-{mode}", route_prefix=f"/{mode}")
        urls = {mode: f"http://127.0.0.1:{port}/{mode}" for mode in args.modes}
        startup = {mode: replica_startup(f"core-{mode}") for mode in args.modes}
        print(json.dumps({"replica_startup": startup}), flush=True)
        for mode in args.modes:  # warm-up: adapters, the gate's first measurements, every connection
            asyncio.run(window(urls[mode], model, args))
        load, rows = os.getloadavg()[0], []
        for w in range(args.windows):
            for mode in args.modes:
                before = core_counters(f"core-{mode}")
                result = asyncio.run(window(urls[mode], model, args))
                after = core_counters(f"core-{mode}")
                steps = max(1, after["steps"] - before["steps"])
                busy = after["step_s"] + after["publish_s"] - before["step_s"] - before["publish_s"]
                ttft = result.pop("ttft_ms")
                row = {"mode": mode, "window": w, "concurrency": args.concurrency, **result,
                       "ttft_p50_ms": percentile(ttft, 0.5), "ttft_p99_ms": percentile(ttft, 0.99),
                       "core_steps": steps, "core_ms_per_step": round(busy / steps * 1e3, 3)}
                print(json.dumps(row), flush=True)
                rows.append(row | {"ttft_all_ms": [t * 1e3 for t in ttft]})
        print(json.dumps(summary(rows, (load, os.getloadavg()[0]), model)), flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
