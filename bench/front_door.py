"""The data plane's front door under floods, through the real app (`bind_app` on a local Ray cluster, the demo model
on CPU, 2 LLM replicas, SQLite registry in a temp dir; no stub anywhere):

1. malformed bodies: `--flood` bodies that are not JSON from one tenant at `--concurrency`, while another tenant
   sends chat requests one after another: the flood's answers by status, and the other tenant's median latency
   before and during it (acceptance: during within 1.5x of before);
2. long prompts: a 1.9 MB prompt's refusal time (median and max of `--probes`, one at a time), then bursts of
   `--long` such prompts at `--long-concurrency` from one tenant, a burst every `--long-pause` seconds until the
   other tenant has `--samples` answers, with its median before and during a burst (the requests that ran while
   one did; acceptance: refused in under 50 ms; during within 1.3x), and how many Serve's proxy refused
   (`proxy_guard`; `--no-proxy-guard` leaves them to the ingress). Each of the burst's clients sends from its own loopback address (127.0.0.11, ...), so at
   10 refusals a client a burst none is benched: every prompt is read, parsed and refused by the length check.

    python bench/front_door.py                       # SmolLM2-135M-Instruct demo (the default app)
    python bench/front_door.py --recipe quick        # the toy demo: seconds to start

The floods run in a child process (asyncio + httpx), so their client's CPU is not this process's GIL. Prints one
JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KEYS = {"sk-bench-flood-0001": "flood", "sk-bench-other-0001": "other", "sk-bench-probe-0001": "probe",
        "sk-bench-long-00001": "long"}
FLOOD, OTHER, PROBE, LONG = list(KEYS)
CHAT = [{"role": "user", "content": "Write a function that adds two numbers."}]
LONG_CHARS = 1_900_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_app(recipe: str, root: Path, proxy_guard_on: bool = True) -> tuple[str, str]:
    """The real app on a local cluster -> (base URL, base model name)."""
    import ray
    from ray import serve

    from deployments.application import bind_app
    from deployments.bootstrap import bootstrap
    from deployments.config import load_config
    from deployments.data_plane import proxy_guard

    registry = {"registry_db": str(root / "registry.db"), "blob_dir": str(root / "blobs"),
                "materialize_dir": str(root / "materialized"), "upload_dir": str(root / "uploads")}
    args = {"demo_recipe": recipe, "num_replicas": 2, "api_keys": KEYS, "registry": registry,
            "tenant_rates": {"other": {"rate": 1e6, "burst": 1e6}},  # the measured tenant is never limited
            "proxy_prompt_guard": proxy_guard_on}
    cfg = bootstrap(load_config(args, env={}))
    if cfg.proxy_prompt_guard:  # as build_app names it for the cluster `serve run` starts
        proxy_guard.install(os.environ)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(bind_app(cfg), name="front-door", route_prefix="/")
    return f"http://127.0.0.1:{port}", cfg.base_model_name


# ---------------------------------------------------------------------------------------------- the floods
async def _send(http, url: str, key: str, body: bytes, n: int, codes: list[int]) -> None:
    for _ in range(n):
        r = await http.post(url, content=body, headers={"Authorization": f"Bearer {key}",
                                                        "Content-Type": "application/json"})
        codes.append(r.status_code)


async def _flood(url: str, key: str, body: bytes, total: int, concurrency: int, stop, pause_s: float,
                 own_addresses: bool) -> dict:
    """`total` bodies at `concurrency`; with `stop`, again after `pause_s` until it is set. `own_addresses`: each
    client from its own loopback address."""
    import httpx

    def client(i: int) -> httpx.AsyncClient:
        transport = httpx.AsyncHTTPTransport(local_address=f"127.0.0.{11 + i}") if own_addresses else None
        return httpx.AsyncClient(timeout=120, transport=transport)

    codes: list[int] = []
    bursts: list[tuple[float, float]] = []  # wall-clock (start, end) of each burst
    t0 = time.perf_counter()
    https = [client(i) for i in range(concurrency)]
    while True:
        shares = [total // concurrency + (i < total % concurrency) for i in range(concurrency)]
        start = time.time()
        await asyncio.gather(*(_send(h, url, key, body, n, codes) for h, n in zip(https, shares)))
        bursts.append((start, time.time()))
        if stop is None or stop.is_set():
            break
        await asyncio.sleep(pause_s)
    for h in https:
        await h.aclose()
    burst_s = [b - a for a, b in bursts]
    return {"sent": len(codes), "bursts": len(bursts), "seconds": round(time.perf_counter() - t0, 2),
            "burst_s_median": round(statistics.median(burst_s), 3),
            "codes": {str(c): codes.count(c) for c in sorted(set(codes))}, "_spans": bursts}


def flood_process(url, key, body, total, concurrency, stop, pause_s, own_addresses, out) -> None:
    out.put(asyncio.run(_flood(url, key, body, total, concurrency, stop, pause_s, own_addresses)))


def run_flood(url: str, key: str, body: bytes, total: int, concurrency: int, until=None, pause_s: float = 0.0,
              own_addresses: bool = False):
    """A child process sending `total` bodies (in bursts until `until` is set) -> (process, result queue)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=flood_process, daemon=True,
                       args=(url, key, body, total, concurrency, until, pause_s, own_addresses, out))
    proc.start()
    return proc, out


# --------------------------------------------------------------------------------------- the other tenant
class Timed(float):
    """A request's latency, and when it ran (wall clock)."""

    start: float
    end: float


def chat_latencies(client, model: str, n: int = 0, until: threading.Event | None = None) -> list[Timed]:
    """Latencies of chat requests one after another: `n` of them, or until `until` is set."""
    out = []
    while (n and len(out) < n) or (until is not None and not until.is_set()):
        start, t0 = time.time(), time.perf_counter()
        client.chat.completions.create(model=model, messages=CHAT, max_tokens=16, temperature=0)
        lat = Timed(time.perf_counter() - t0)
        lat.start, lat.end = start, time.time()
        out.append(lat)
    return out


def overlapping(lat: list[Timed], spans: list[tuple[float, float]]) -> list[Timed]:
    """The requests that ran while some burst did."""
    return [x for x in lat if any(x.start < b and a < x.end for a, b in spans)]


def during(client, model: str, flood, samples: int = 0) -> tuple[list[float], dict]:
    """The other tenant's latencies while `flood` = (process, queue, stop event or None) runs."""
    proc, out, stop = flood
    done = threading.Event()
    lat: list[float] = []
    waiter = threading.Thread(target=lambda: (proc.join(), done.set()), daemon=True)
    waiter.start()
    time.sleep(0.5)  # the flood under way
    if stop is None:
        lat = chat_latencies(client, model, until=done)
    else:
        lat = chat_latencies(client, model, n=samples)
        stop.set()
    result = out.get(timeout=600)
    proc.join()
    return lat, result


def median(xs) -> float:
    return round(statistics.median(xs), 4) if xs else float("nan")


def malformed(url: str, client, model: str, args) -> dict:
    """1. Bodies that are not JSON."""
    quiet = chat_latencies(client, model, n=args.samples)
    broken = b'{"model": "' + model.encode() + b'", "messages": ['
    proc, out = run_flood(url + "/v1/chat/completions", FLOOD, broken, args.flood, args.concurrency)
    lat, flood = during(client, model, (proc, out, None))
    flood.pop("_spans")
    return {"flood": flood, "other_median_s": [median(quiet), median(lat)],
            "ratio": round(median(lat) / median(quiet), 3), "other_requests_during": len(lat)}


def refused_in_proxy(url: str) -> int:
    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text
    return int(sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("loraserve_prompts_refused_in_proxy_total")))


def long_prompts(url: str, client, model: str, args) -> dict:
    """2. Prompts too long for the context: one at a time (how fast each is refused), then in bursts."""
    import httpx

    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "x" * LONG_CHARS}]}).encode()
    headers = {"Authorization": f"Bearer {PROBE}", "Content-Type": "application/json"}
    probes = []
    with httpx.Client(timeout=60) as http:
        # the proxies read the ingress's published limits every few seconds: one refused there before the timing
        deadline = time.monotonic() + (0 if args.no_proxy_guard else 20)
        while refused_in_proxy(url) == 0 and time.monotonic() < deadline:
            http.post(url + "/v1/chat/completions", content=body, headers=headers)
            time.sleep(0.5)
        for _ in range(args.probes):
            t0 = time.perf_counter()
            r = http.post(url + "/v1/chat/completions", content=body, headers=headers)
            probes.append(time.perf_counter() - t0)
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
    quiet = chat_latencies(client, model, n=args.samples)
    stop = mp.get_context("spawn").Event()
    before = refused_in_proxy(url)
    proc, out = run_flood(url + "/v1/chat/completions", LONG, body, args.long, args.long_concurrency, stop,
                          args.long_pause, own_addresses=True)
    lat, flood = during(client, model, (proc, out, stop), samples=args.samples)
    hit = overlapping(lat, flood.pop("_spans"))
    return {"bytes": len(body), "refused_s": {"median": median(probes), "max": round(max(probes), 4)},
            "flood": flood, "refused_in_proxy": refused_in_proxy(url) - before,
            "other_median_s": [median(quiet), median(hit)], "ratio": round(median(hit) / median(quiet), 3),
            "other_requests_during": len(hit), "other_median_s_all_requests": median(lat)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="smollm2", choices=["smollm2", "quick", "toy"])
    ap.add_argument("--flood", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--long", type=int, default=40)
    ap.add_argument("--long-concurrency", type=int, default=4)
    ap.add_argument("--long-pause", type=float, default=3.0, help="seconds between bursts of long prompts")
    ap.add_argument("--probes", type=int, default=10)
    ap.add_argument("--samples", type=int, default=30, help="the other tenant's requests per window")
    ap.add_argument("--parts", nargs="+", default=["malformed", "long"], choices=["malformed", "long"])
    ap.add_argument("--no-proxy-guard", action="store_true", help="long prompts refused by the ingress alone")
    args = ap.parse_args()

    import httpx
    import openai
    import ray

    root = Path(tempfile.mkdtemp(prefix="front-door-"))
    url, model = start_app(args.recipe, root, proxy_guard_on=not args.no_proxy_guard)
    client = openai.OpenAI(base_url=url + "/v1", api_key=OTHER, max_retries=0, timeout=120)
    chat_latencies(client, model, n=5)  # warm: both replicas, the ingress has its prompt bound
    report: dict = {"app": {"recipe": args.recipe, "llm_replicas": 2, "engine": "the demo model on CPU",
                            "proxy_prompt_guard": not args.no_proxy_guard}}

    if "malformed" in args.parts:
        report["malformed"] = malformed(url, client, model, args)
    if "long" in args.parts:
        report["long_prompt"] = long_prompts(url, client, model, args)
    print(json.dumps(report))
    ray.shutdown()


if __name__ == "__main__":
    main()
