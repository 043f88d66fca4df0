"""The skewed adapter request mix of the affinity benchmark and how it is scored (shared by
`bench/affinity.py` and `tests/router/test_affinity_e2e.py`)."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter, defaultdict
from typing import Iterable, Optional

import httpx

__all__ = ["zipf_mix", "prefix_mix", "send_mix", "score", "prefix_score"]


def zipf_mix(adapters: list[str], n: int, s: float = 1.1, seed: int = 0) -> list[str]:
    """`n` adapter names drawn with probability ~ 1 / rank**s (rank 1 = adapters[0])."""
    weights = [1.0 / (i + 1) ** s for i in range(len(adapters))]
    return random.Random(seed).choices(adapters, weights=weights, k=n)


def prefix_mix(adapters: list[str], n: int, prefixes: int, s: float = 1.1, seed: int = 0) -> list[tuple[str, str]]:
    """`n` (adapter, prompt) pairs: adapters as `zipf_mix`, each request one of its adapter's `prefixes` system
    prompts (~700 characters, ~10 KV blocks of the demo model: long enough for the ingress's fingerprint) drawn
    uniformly, then a question of its own."""
    rng = random.Random(seed + 1)
    mix = []
    for i, adapter in enumerate(zipf_mix(adapters, n, s, seed)):
        k = rng.randrange(prefixes)
        system = f"System prompt {k} of {adapter}: you answer questions about topic {k} tersely. " * 9
        mix.append((adapter, f"{system}\nQuestion {i}: what is {rng.randrange(1000)}?\nAnswer:"))
    return mix


async def send_mix(base_url: str, key: str, mix: Iterable[str | tuple[str, str]], concurrency: int = 4,
                   max_tokens: int = 2, rate: Optional[float] = None) -> list[dict]:
    """POST one completion per entry (an adapter, prompt "def ", or an (adapter, prompt) pair), at most
    `concurrency` at a time and, with `rate`, entry i no earlier than i / rate seconds after the first (the mix
    then spans a wall time of its own, however fast the replicas answer);
    -> [{adapter, prefix, replica, hit, status}] in completion order (prefix: the prompt's first line)."""
    queue: asyncio.Queue = asyncio.Queue()
    for i, adapter in enumerate(mix):
        queue.put_nowait((i, adapter))
    results: list[dict] = []
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=base_url, timeout=120,
                                 headers={"Authorization": f"Bearer {key}"}) as http:
        async def worker() -> None:
            while not queue.empty():
                i, entry = queue.get_nowait()
                if rate:
                    await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
                adapter, prompt = (entry, "def ") if isinstance(entry, str) else entry
                r = await http.post("/v1/completions", json={"model": adapter, "prompt": prompt,
                                                             "max_tokens": max_tokens, "temperature": 0})
                results.append({"adapter": adapter, "prefix": prompt.split("\n")[0], "status": r.status_code,
                                "replica": r.headers.get("x-loraserve-replica"),
                                "hit": r.headers.get("x-loraserve-adapter-hit") == "1"})

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


def score(results: list[dict], hot: int = 2) -> dict:
    """Hit rate after each adapter's first load, and how many replicas served the hot adapters."""
    seen: set[str] = set()
    counted = hits = 0
    replicas_of: dict[str, set] = defaultdict(set)
    for r in results:
        replicas_of[r["adapter"]].add(r["replica"])
        if r["adapter"] not in seen:
            seen.add(r["adapter"])  # its first request must load it somewhere
            continue
        counted += 1
        hits += r["hit"]
    top = [a for a, _ in Counter(r["adapter"] for r in results).most_common(hot)]
    return {
        "requests": len(results),
        "errors": sum(r["status"] != 200 for r in results),
        "adapters": len(seen),
        "hit_rate_after_first_load": hits / counted if counted else 0.0,
        "hot_adapters": {a: len(replicas_of[a]) for a in top},
        "replicas_used": len({r["replica"] for r in results}),
        "loads": len({(r["adapter"], r["replica"]) for r in results}),
    }


def prefix_score(results: list[dict]) -> dict:
    """How often a request whose (adapter, prefix) was served before went to a replica that had served it (where its
    KV may be cached), each pair's first request left out."""
    served: dict[tuple[str, str], set] = defaultdict(set)
    counted = back = 0
    for r in results:
        pair = (r["adapter"], r["prefix"])
        if served[pair]:
            counted += 1
            back += r["replica"] in served[pair]
        served[pair].add(r["replica"])
    return {"prefixes": len(served), "prefix_routed_back": back / counted if counted else 0.0,
            "prefix_computations": sum(len(v) for v in served.values())}
