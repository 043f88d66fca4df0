"""Adapter-affinity benchmark: the real Serve app on CPU, N adapters, a Zipf request mix,
once with `router.AffinityRouter` and once with Ray Serve's default router. Prints JSON.

    python bench/affinity.py [--replicas 2] [--adapters 20] [--capacity 64] [--requests 400] [--concurrency 4]
    python bench/affinity.py --prefixes 4 --routers affinity,affinity_no_prefix   # prefix affinity on and off

A request is a hit when the replica that served it already held the adapter (header
`x-loraserve-adapter-hit`); each adapter's very first request is left out (it must load
somewhere). Ray's default router sees the same residency (the replicas push their adapter
ids to the controller on every load, like `@serve.multiplexed`); `ray_default_no_push` is
Ray's default router with only the periodic routing stats (no multiplexed ids at all).

With `--prefixes K`, each adapter has K long system prompts and every request starts with one of its adapter's
(bench/affinity_mix.prefix_mix); a run also reports how often a repeated (adapter, prompt) pair went back to a
replica that had served it (`prefix_routed_back`) and the replicas' prefix-cache hit rate in tokens (from
/metrics). `affinity_no_prefix` is the affinity router with `prefix_affinity` off.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from affinity_mix import prefix_mix, prefix_score, score, send_mix, zipf_mix  # noqa: E402

KEY = "sk-bench-key-0001"
# Ray's logical CPUs are scheduling tokens, not cores: the cluster gets 2 of them whatever the machine,
# the ingress a quarter and the LLM replicas split the rest, so any replica count fits.
CLUSTER_CPUS = 2
INGRESS_CPUS = 0.25


def replica_cpus(replicas: int) -> float:
    """Each LLM replica's CPU share: 0.5 while that fits, else an equal split of what the ingress leaves."""
    return min(0.5, (CLUSTER_CPUS - INGRESS_CPUS) / replicas)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _setup(root: Path, affinity: bool, replicas: int, adapters: list[str], push: bool = True,
           capacity: int = 64, prefix_affinity: bool = True):
    from deployments.bootstrap import sha256_of_dir, bootstrap, demo_paths, make_registry
    from deployments.config import load_config

    incoming = root / "incoming"
    incoming.mkdir(parents=True)
    args = {
        "demo_recipe": "quick", "num_replicas": replicas, "num_cpus_per_replica": replica_cpus(replicas),
        "ingress_num_cpus": INGRESS_CPUS,
        "routing_stats_period_s": 0.5, "api_keys": {KEY: "bench"}, "admin_token": "bench-admin-token",
        "tenant_rate": {"rate": 1e6, "burst": 1e6}, "adapter_rate": {"rate": 1e6, "burst": 1e6},
        "affinity_router": affinity, "push_residency": push, "router": {"prefix_affinity": prefix_affinity},
        "max_cpu_loras": capacity, "max_loras": min(8, capacity),
        "registry": {"registry_db": str(root / "registry.db"), "blob_dir": str(root / "blobs"),
                     "materialize_dir": str(root / "materialized"), "allowed_local_roots": [str(incoming)]},
    }
    cfg = bootstrap(load_config(args, env={}))
    demo = demo_paths(cfg)["adapters"]
    sources = sorted(demo)
    reg = make_registry(cfg)
    for i, name in enumerate(adapters):
        d = incoming / name
        shutil.copytree(demo[sources[i % len(sources)]], d)
        reg.register(name, str(d), sha256_of_dir(d), cfg.base_model_name, actor="bench", activate=True)
    reg.close()
    return cfg


def _prefix_cache_hit_rate(base_url: str) -> float | None:
    """Prefix-cache hits over queries (tokens), summed over the replicas' series in /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    totals = {"hits": 0.0, "queries": 0.0}
    for fam in text_string_to_metric_families(httpx.get(f"{base_url}/metrics", timeout=30).text):
        for sample in fam.samples:
            for kind in totals:
                if sample.name == f"loraserve_replica_prefix_cache_{kind}_total":
                    totals[kind] += sample.value
    return totals["hits"] / totals["queries"] if totals["queries"] else None


def run_one(router: str, replicas: int, n: int, concurrency: int, num_adapters: int, seed: int, port: int,
            capacity: int, prefixes: int = 0, rate: float | None = None) -> dict:
    from ray import serve

    from deployments.application import bind_app

    adapters = [f"bench-{i:02d}" for i in range(num_adapters)]
    root = Path(tempfile.mkdtemp(prefix=f"affinity-{router}-"))
    try:
        cfg = _setup(root, router.startswith("affinity"), replicas, adapters, push=router != "ray_default_no_push",
                     capacity=capacity, prefix_affinity=router != "affinity_no_prefix")
        serve.run(bind_app(cfg), name=f"bench-{router}", route_prefix="/")
        base_url = f"http://127.0.0.1:{port}"
        mix = prefix_mix(adapters, n, prefixes, seed=seed) if prefixes else zipf_mix(adapters, n, seed=seed)
        t0 = time.perf_counter()
        results = asyncio.run(send_mix(base_url, KEY, mix, concurrency=concurrency, rate=rate))
        out = {"router": router, "seconds": round(time.perf_counter() - t0, 1), **score(results)}
        if prefixes:
            time.sleep(2.0)  # the replicas' last reports reach the ingress's /metrics
            out |= prefix_score(results) | {"prefix_cache_hit_rate": _prefix_cache_hit_rate(base_url)}
        serve.delete(f"bench-{router}")
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--adapters", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--capacity", type=int, default=64, help="adapters a replica holds (max_cpu_loras)")
    p.add_argument("--routers", default="affinity,ray_default",
                   help="of affinity, affinity_no_prefix, ray_default, ray_default_no_push")
    p.add_argument("--prefixes", type=int, default=0, help="system prompts per adapter (0: every prompt 'def ')")
    p.add_argument("--rate", type=float, default=None,
                   help="arrivals per second (at most --concurrency in flight); default: closed loop")
    a = p.parse_args()

    import ray
    from ray import serve

    ray.init(num_cpus=CLUSTER_CPUS, include_dashboard=False, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        runs = [run_one(r, a.replicas, a.requests, a.concurrency, a.adapters, a.seed, port, a.capacity, a.prefixes,
                        a.rate)
                for r in a.routers.split(",")]
    finally:
        serve.shutdown()
        ray.shutdown()
    print(json.dumps({"benchmark": "adapter_affinity", "replicas": a.replicas, "requests": a.requests,
                      "concurrency": a.concurrency, "adapters": a.adapters, "capacity": a.capacity, "zipf_s": 1.1,
                      "prefixes": a.prefixes, "rate": a.rate,
                      "runs": runs}))


if __name__ == "__main__":
    main()
