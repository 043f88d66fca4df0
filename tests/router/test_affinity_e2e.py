"""Adapter affinity through the real Serve app (2 LLM replicas, `router.AffinityRouter`):
with 20 adapters and a skewed mix, >= 95% of requests after an adapter's first load land on
a replica already holding it, and the hot adapters are served by at least 2 replicas."""

import asyncio
import itertools
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from router.keys import AdapterKey
from tests.deployments.serve_harness import AFFINITY_ADAPTERS, LOAD_KEY

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from affinity_mix import score, send_mix, zipf_mix  # noqa: E402

pytestmark = pytest.mark.slow


def _pinned_on_every_replica(serve_app, families: list[str], timeout_s: float, results: list[dict]) -> dict:
    """Keep the skewed traffic coming (40 requests at a time, appended to `results`) until every LLM replica reports
    each of `families` in a device slot (the placement pinned it there), at most `timeout_s`; -> the last routing
    stats seen. Popularity is a decayed rate over the whole app: an adapter an earlier test used heavily can hold a
    pinned place until this traffic outweighs it."""
    deadline = time.monotonic() + timeout_s
    for seed in itertools.count(2):
        stats = serve_app.replica_stats()
        on_device = [{AdapterKey.family(k) for k in s.get("device_adapters", ())} for s in stats.values()]
        if (len(stats) == 2 and all(set(families) <= held for held in on_device)) or time.monotonic() > deadline:
            return stats
        results += asyncio.run(send_mix(serve_app.base_url, LOAD_KEY, zipf_mix(AFFINITY_ADAPTERS, n=40, seed=seed),
                                        concurrency=4, rate=20.0))


def test_affinity_hit_rate_and_hot_replication(serve_app):
    mix = zipf_mix(AFFINITY_ADAPTERS, n=240, seed=1)
    hot = [a for a, _ in Counter(mix).most_common(2)]
    # First half at 20 requests a second (6 s however fast the replicas answer): the placement sees the hot
    # adapters and pins each on both replicas. How long that takes depends on the machine's load (a re-plan a
    # second, then each replica's sync, fetch and warm-up) and on what earlier tests sent, so the traffic goes on
    # until it has happened, bounded, rather than racing it; the second half then finds two homes with the adapter
    # on the device for each hot adapter.
    results = asyncio.run(send_mix(serve_app.base_url, LOAD_KEY, mix[:120], concurrency=4, rate=20.0))
    waited = time.monotonic()
    stats = _pinned_on_every_replica(serve_app, hot, timeout_s=60, results=results)
    print(f"hot {hot} on both replicas' devices after {time.monotonic() - waited:.1f} s:",
          {r: v.get("device_adapters") for r, v in stats.items()})
    time.sleep(1.0)  # two of the router's routing-stats polls (0.5 s): it ranks on what they reported
    results += asyncio.run(send_mix(serve_app.base_url, LOAD_KEY, mix[120:], concurrency=4, rate=20.0))
    s = score(results)
    print(s)
    assert s["errors"] == 0 and s["adapters"] >= 15
    assert s["hit_rate_after_first_load"] >= 0.95, s
    on_device = {r: v.get("device_adapters") for r, v in stats.items()}
    assert all(n >= 2 for n in s["hot_adapters"].values()), (s, hot, on_device)
    assert s["replicas_used"] == 2
