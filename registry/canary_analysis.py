"""The analysis of one rollout step, as pure functions over what the replicas measured.

Each LLM replica counts, per adapter version, its requests, errors, refusals, completion tokens, finish reasons
and TTFT / TPOT in fixed latency buckets (deployments.replica.version_stats), beside the engine's drafted and
accepted tokens; its report carries them cumulatively. A step's window is, per replica, the counters now minus
the counters at the step's start (a replica that started since counts from zero), summed over every replica: a
version served on three replicas is judged on all three. Buckets sum like counters, so percentiles of the whole
window come from the summed buckets.

    flat = flat_counters(report, key)                   # one replica, one version: {"requests": 12, "ttft.9": 3, ...}
    base = baseline(reports, keys)                     # at a step's start, kept in the registry
    win = window(reports, base, key)                   # summed deltas since, and the requests per replica
    checks = judge(thresholds, win_canary, win_stable) # each threshold: both values, the limit, passed
    unjudged = not_compared(thresholds, win_canary, win_stable, checks)  # the checks left out, and why
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional

from registry.canary_policy import RolloutPolicy, Thresholds
from registry.rollout_state import Baseline, Check

__all__ = ["LATENCY_BOUNDS", "CHECKS", "bucket_of", "flat_counters", "baseline", "window", "Window", "judge",
           "not_compared", "window_closed", "drafted_enough"]

# Every check `judge` may apply, in its order
CHECKS = ("error_rate", "refusal_rate", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "output_length_max",
          "output_length_min", "finish_reason_shift", "draft_acceptance_min", "draft_acceptance_max")

# Upper bounds (seconds) of the latency buckets: 1 ms x 1.25^i, up to ~10 minutes; one more bucket past the last.
LATENCY_BOUNDS: tuple[float, ...] = tuple(0.001 * 1.25**i for i in range(60))


def bucket_of(seconds: float) -> int:
    """Index of the first bucket whose upper bound holds `seconds` (len(LATENCY_BOUNDS): past the last)."""
    if seconds <= LATENCY_BOUNDS[0]:
        return 0
    i = math.ceil(math.log(seconds / LATENCY_BOUNDS[0], 1.25) - 1e-9)
    return min(i, len(LATENCY_BOUNDS))


def flat_counters(report: Mapping[str, Any], key: str) -> dict[str, float]:
    """One replica's cumulative counters of one version, flat (so windows are per-field differences)."""
    v = (report.get("versions") or {}).get(key) or {}
    a = (report.get("adapters") or {}).get(key) or {}
    out = {f: float(v.get(f) or 0) for f in ("requests", "errors", "refusals", "tokens")}
    for group in ("finish", "ttft", "tpot"):
        out.update({f"{group}.{k}": float(n) for k, n in (v.get(group) or {}).items()})
    out["drafted"] = float(a.get("drafted_tokens") or 0)
    out["accepted"] = float(a.get("accepted_tokens") or 0)
    return {k: n for k, n in out.items() if n}


def baseline(reports: Mapping[str, Mapping[str, Any]], keys: Iterable[str]) -> Baseline:
    keys = list(keys)
    return {rid: {k: flat_counters(rep, k) for k in keys} for rid, rep in reports.items()}


@dataclass
class Window:
    """What one version did within a window, every replica together."""

    counters: dict[str, float] = field(default_factory=dict)
    per_replica: dict[str, float] = field(default_factory=dict)  # replica id -> requests in the window

    def get(self, name: str) -> float:
        return self.counters.get(name, 0.0)

    @property
    def requests(self) -> float:
        return self.get("requests")

    def rate(self, name: str) -> Optional[float]:
        return self.get(name) / self.requests if self.requests else None

    def _buckets(self, group: str) -> dict[int, float]:
        prefix = group + "."
        return {int(k[len(prefix):]): n for k, n in self.counters.items() if k.startswith(prefix) and n > 0}

    def quantile(self, group: str, q: float) -> Optional[float]:
        """The upper bound of the bucket holding the q-quantile of `group` ("ttft", "tpot"); None: no samples."""
        buckets = self._buckets(group)
        total = sum(buckets.values())
        if not total:
            return None
        seen = 0.0
        for i in sorted(buckets):
            seen += buckets[i]
            if seen >= q * total - 1e-9:
                return LATENCY_BOUNDS[min(i, len(LATENCY_BOUNDS) - 1)] * (1.25 if i >= len(LATENCY_BOUNDS) else 1)
        return None

    def finish_shares(self) -> dict[str, float]:
        counts = {k.removeprefix("finish."): n for k, n in self.counters.items() if k.startswith("finish.")}
        total = sum(counts.values())
        return {k: n / total for k, n in sorted(counts.items())} if total else {}

    def mean_tokens(self) -> Optional[float]:
        done = self.requests - self.get("errors") - self.get("refusals")
        return self.get("tokens") / done if done > 0 else None

    def acceptance(self) -> Optional[float]:
        return self.get("accepted") / self.get("drafted") if self.get("drafted") else None

    def summary(self) -> dict[str, Any]:
        """The window as the audit log and `canary status` show it."""
        rnd = lambda x: None if x is None else round(x, 6)  # noqa: E731
        return {"requests": int(self.requests), "errors": int(self.get("errors")),
                "refusals": int(self.get("refusals")), "error_rate": rnd(self.rate("errors")),
                "refusal_rate": rnd(self.rate("refusals")),
                "ttft_p50_s": rnd(self.quantile("ttft", 0.5)), "ttft_p99_s": rnd(self.quantile("ttft", 0.99)),
                "tpot_p50_s": rnd(self.quantile("tpot", 0.5)), "tpot_p99_s": rnd(self.quantile("tpot", 0.99)),
                "mean_completion_tokens": rnd(self.mean_tokens()), "finish_reasons": self.finish_shares(),
                "drafted_tokens": int(self.get("drafted")), "draft_acceptance": rnd(self.acceptance()),
                "per_replica_requests": {r: int(n) for r, n in sorted(self.per_replica.items())}}


def window(reports: Mapping[str, Mapping[str, Any]], base: Baseline, key: str) -> Window:
    """`key`'s counters since `base`, summed over the replicas reporting now (negative deltas, from a counter
    that restarted, count as zero)."""
    win = Window()
    for rid, rep in reports.items():
        start = base.get(rid, {}).get(key, {})
        now = flat_counters(rep, key)
        delta = {f: max(0.0, n - start.get(f, 0.0)) for f, n in now.items()}
        for f, n in delta.items():
            if n:
                win.counters[f] = win.counters.get(f, 0.0) + n
        if delta.get("requests"):
            win.per_replica[rid] = delta["requests"]
    return win


def window_closed(policy: RolloutPolicy, canary: Window, stable: Window, elapsed_s: float) -> bool:
    """The step's window is full: enough canary requests (at least one), enough stable ones, long enough, and (with
    thresholds.require_draft_acceptance) enough drafts of each to compare their acceptance."""
    t = policy.thresholds
    return (canary.requests >= max(1, policy.window_requests) and stable.requests >= policy.min_stable_requests
            and elapsed_s >= policy.window_s and (not t.require_draft_acceptance or drafted_enough(t, canary, stable)))


def drafted_enough(t: Thresholds, canary: Window, stable: Window) -> bool:
    """Both versions drafted min_drafted_tokens in the window: their acceptance can be compared."""
    return canary.get("drafted") >= t.min_drafted_tokens and stable.get("drafted") >= t.min_drafted_tokens


def _upper(name: str, c: Optional[float], s: Optional[float], limit_of) -> Optional[Check]:
    """canary <= limit_of(stable); skipped (None) when either side has no value."""
    if c is None or s is None:
        return None
    limit = limit_of(s)
    return Check(name=name, canary=c, stable=s, limit=limit, passed=c <= limit + 1e-12)


def judge(t: Thresholds, c: Window, s: Window) -> list[Check]:
    """Every threshold that both windows have data for, applied: the canary passes if all pass."""
    checks = [
        _upper("error_rate", c.rate("errors"), s.rate("errors"), lambda x: x + t.max_error_rate_increase),
        _upper("refusal_rate", c.rate("refusals"), s.rate("refusals"), lambda x: x + t.max_refusal_rate_increase),
        _upper("ttft_p50_s", c.quantile("ttft", 0.5), s.quantile("ttft", 0.5),
               lambda x: x * t.ttft_p50_ratio + t.latency_slack_s),
        _upper("ttft_p99_s", c.quantile("ttft", 0.99), s.quantile("ttft", 0.99),
               lambda x: x * t.ttft_p99_ratio + t.latency_slack_s),
        _upper("tpot_p50_s", c.quantile("tpot", 0.5), s.quantile("tpot", 0.5),
               lambda x: x * t.tpot_p50_ratio + t.latency_slack_s),
        _upper("tpot_p99_s", c.quantile("tpot", 0.99), s.quantile("tpot", 0.99),
               lambda x: x * t.tpot_p99_ratio + t.latency_slack_s),
        _upper("output_length_max", c.mean_tokens(), s.mean_tokens(),
               lambda x: x * t.output_length_ratio + t.output_length_slack),
    ]
    cm, sm = c.mean_tokens(), s.mean_tokens()
    if cm is not None and sm is not None:
        low = sm / t.output_length_ratio - t.output_length_slack
        checks.append(Check(name="output_length_min", canary=cm, stable=sm, limit=low, passed=cm >= low - 1e-12))
    cf, sf = c.finish_shares(), s.finish_shares()
    if cf and sf:
        shift = 0.5 * sum(abs(cf.get(k, 0.0) - sf.get(k, 0.0)) for k in set(cf) | set(sf))
        checks.append(Check(name="finish_reason_shift", canary=shift, stable=0.0, limit=t.max_finish_reason_shift,
                            passed=shift <= t.max_finish_reason_shift + 1e-12))
    if drafted_enough(t, c, s):
        # Two-sided: a version that answers differently moves the base model's acceptance of its drafts, down when
        # it says other things than the base would, up when it degenerates into text the base predicts (a loop).
        ca, sa = c.acceptance(), s.acceptance()
        low = sa - t.max_acceptance_drop
        checks.append(Check(name="draft_acceptance_min", canary=ca, stable=sa, limit=low, passed=ca >= low - 1e-12))
        checks.append(_upper("draft_acceptance_max", ca, sa, lambda x: x + t.max_acceptance_rise))
    return [ch for ch in checks if ch is not None]


def not_compared(t: Thresholds, c: Window, s: Window, checks: list[Check]) -> dict[str, str]:
    """The checks `judge` left out for want of data, each with why, so that a step that passed says what it was
    not judged on (above all the draft acceptance: on a CPU, or with few adapter requests at a time, the engine's
    gate may choose plain steps and draft nothing)."""
    done = {ch.name for ch in checks}
    out = {}
    for name in CHECKS:
        if name in done:
            continue
        if name.startswith("draft_acceptance"):
            out[name] = (f"drafted tokens: canary {int(c.get('drafted'))}, stable {int(s.get('drafted'))}; each "
                         f"needs min_drafted_tokens ({t.min_drafted_tokens}): the engine drafted too little")
        else:
            out[name] = "no sample in the canary's or the stable version's window"
    return out
