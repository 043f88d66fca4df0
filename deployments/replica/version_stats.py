"""What each adapter version's requests did on this replica, for the rollout analysis (registry.canary_analysis):
requests, errors (the replica's faults), refusals (the engine's or the replica's 4xx), completion tokens, finish
reasons, and TTFT and TPOT in the analysis's fixed latency buckets, all cumulative so that any window is a
difference of two reads. The engine counts drafted and accepted tokens per version already (its `stats()`).

`VersionStats.track(key, started_at)` follows one request's chunks (deployments.data_plane.protocol); requests
labelled `purpose=golden` (the rollout's own golden prompts) are not counted, so the analysis sees client traffic
only. At most `max_keys` versions are kept, the least recently used dropped first.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Optional

from registry.canary_analysis import bucket_of

__all__ = ["VersionStats", "RequestTrack", "GOLDEN_LABEL"]

GOLDEN_LABEL = ("purpose", "golden")  # GenerateRequest.labels item of a golden-prompt run


def _new() -> dict[str, Any]:
    return {"requests": 0, "errors": 0, "refusals": 0, "tokens": 0, "finish": {}, "ttft": {}, "tpot": {}}


class VersionStats:
    def __init__(self, clock: Callable[[], float], max_keys: int = 512):
        self._clock, self._max = clock, max_keys
        self._by_key: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def _entry(self, key: str) -> dict[str, Any]:
        entry = self._by_key.get(key)
        if entry is None:
            entry = self._by_key[key] = _new()
            while len(self._by_key) > self._max:
                self._by_key.popitem(last=False)
        self._by_key.move_to_end(key)
        return entry

    def track(self, key: Optional[str], started_at: float, labels: Optional[dict] = None) -> "RequestTrack":
        counted = key is not None and (labels or {}).get(GOLDEN_LABEL[0]) != GOLDEN_LABEL[1]
        return RequestTrack(self, key if counted else None, started_at)

    def report(self) -> dict[str, dict[str, Any]]:
        """key -> its counters (histograms as {bucket index: count}, string keys: the report crosses JSON)."""
        return {k: {**v, "finish": dict(v["finish"]), "ttft": dict(v["ttft"]), "tpot": dict(v["tpot"])}
                for k, v in self._by_key.items()}

    def _add(self, key: str, ttft: Optional[float], tpot: Optional[float], tokens: int, finishes: list[str],
             failure: Optional[str]) -> None:
        e = self._entry(key)
        e["requests"] += 1
        if failure is not None:
            e[failure] += 1
            return
        e["tokens"] += tokens
        for reason in finishes:
            e["finish"][reason] = e["finish"].get(reason, 0) + 1
        for group, seconds in (("ttft", ttft), ("tpot", tpot)):
            if seconds is not None:
                b = str(bucket_of(max(0.0, seconds)))
                e[group][b] = e[group].get(b, 0) + 1


class RequestTrack:
    """One request: `chunk(c)` for each chunk it streams, `failed()` if it raised. Counted once, at its end."""

    def __init__(self, stats: VersionStats, key: Optional[str], started_at: float):
        self._stats, self._key, self._started = stats, key, started_at
        self._first: Optional[float] = None
        self._done = key is None

    def chunk(self, c: dict) -> None:
        if self._done:
            return
        kind = c.get("type")
        if kind == "delta" and self._first is None and c.get("num_tokens"):
            self._first = self._stats._clock()
        elif kind == "end":
            now, tokens = self._stats._clock(), int(c.get("completion_tokens") or 0)
            choices = max(1, len(c.get("finish_reasons") or {0: None}))
            per_choice = tokens / choices
            tpot = (now - self._first) / (per_choice - 1) if self._first is not None and per_choice > 1 else None
            ttft = None if self._first is None else self._first - self._started
            finishes = [str(r) for r in (c.get("finish_reasons") or {0: c.get("finish_reason")}).values()]
            self._finish(ttft, tpot, round(per_choice), finishes, None)
        elif kind == "error":
            self._finish(None, None, 0, [], "refusals" if 400 <= int(c.get("status", 500)) < 500 else "errors")

    def failed(self) -> None:
        if not self._done:
            self._finish(None, None, 0, [], "errors")

    def _finish(self, ttft, tpot, tokens, finishes, failure) -> None:
        self._done = True
        self._stats._add(self._key, ttft, tpot, tokens, finishes, failure)
