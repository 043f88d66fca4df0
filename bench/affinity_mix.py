"""The skewed adapter request mix of the affinity benchmark and how it is scored (shared by
`bench/affinity.py` and `tests/router/test_affinity_e2e.py`)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter, defaultdict
from typing import Iterable

import httpx

__all__ = ["zipf_mix", "send_mix", "score"]


def zipf_mix(adapters: list[str], n: int, s: float = 1.1, seed: int = 0) -> list[str]:
    """`n` adapter names drawn with probability ~ 1 / rank**s (rank 1 = adapters[0])."""
    weights = [1.0 / (i + 1) ** s for i in range(len(adapters))]
    return random.Random(seed).choices(adapters, weights=weights, k=n)


async def send_mix(base_url: str, key: str, mix: Iterable[str], concurrency: int = 4,
                   max_tokens: int = 2) -> list[dict]:
    """POST one completion per entry; -> [{adapter, replica, hit, status}] in completion order."""
    queue: asyncio.Queue = asyncio.Queue()
    for adapter in mix:
        queue.put_nowait(adapter)
    results: list[dict] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=120,
                                 headers={"Authorization": f"Bearer {key}"}) as http:
        async def worker() -> None:
            while not queue.empty():
                adapter = queue.get_nowait()
                r = await http.post("/v1/completions", json={"model": adapter, "prompt": "def ",
                                                             "max_tokens": max_tokens, "temperature": 0})
                results.append({"adapter": adapter, "status": r.status_code,
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
