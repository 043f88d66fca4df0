"""The rollout analysis as pure functions: latency buckets, windows summed over replicas from the replicas' own
recorder (deployments.replica.version_stats), every threshold as a table, policies no version could pass, and
golden prompt checks."""

from __future__ import annotations

import pytest

from deployments.replica.version_stats import VersionStats
from registry.canary_analysis import (CHECKS, LATENCY_BOUNDS, Window, baseline, bucket_of, judge, not_compared, window,
                                     window_closed)
from registry.canary_policy import GoldenPrompt, RolloutPolicy, Thresholds, golden_failure


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def serve(stats: VersionStats, clock: Clock, key: str, n: int, ttft=0.05, tpot=0.01, tokens=10, finish="stop",
          status=None):
    """`n` requests of `key` through the replica's recorder, each `ttft` to its first token, `tpot` per token."""
    for _ in range(n):
        track = stats.track(key, clock.t)
        if status is not None:
            track.chunk({"type": "error", "status": status})
            continue
        clock.t += ttft
        track.chunk({"type": "delta", "num_tokens": 1})
        clock.t += tpot * (tokens - 1)
        track.chunk({"type": "end", "completion_tokens": tokens, "finish_reasons": {0: finish}})


def report(stats: VersionStats, drafted: dict | None = None) -> dict:
    """A replica's report as LLMServer.report() makes it: its version counters and the engine's draft counters."""
    return {"versions": stats.report(),
            "adapters": {k: {"drafted_tokens": d, "accepted_tokens": a} for k, (d, a) in (drafted or {}).items()}}


@pytest.mark.parametrize("seconds,bucket", [(0.0, 0), (0.001, 0), (0.00125, 1), (0.0013, 2), (0.05, 18),
                                            (1e9, len(LATENCY_BOUNDS))])
def test_latency_bucket_holds_its_value(seconds, bucket):
    assert bucket_of(seconds) == bucket
    if bucket < len(LATENCY_BOUNDS):
        assert seconds <= LATENCY_BOUNDS[bucket] + 1e-15
        assert bucket == 0 or seconds > LATENCY_BOUNDS[bucket - 1]


def test_window_sums_every_replica_since_the_baseline_and_skips_golden_runs():
    clock = Clock()
    a, b = VersionStats(clock), VersionStats(clock)
    serve(a, clock, "x@2", 3)
    base = baseline({"ra": report(a)}, ["x@2"])  # rb has not started yet: it counts from zero
    serve(a, clock, "x@2", 4, tokens=6)
    serve(b, clock, "x@2", 2, tokens=12, finish="length")
    serve(b, clock, "x@2", 1, status=503)
    golden = b.track("x@2", clock.t, {"purpose": "golden"})  # the rollout's own prompt: not client traffic
    golden.chunk({"type": "end", "completion_tokens": 99, "finish_reasons": {0: "length"}})
    win = window({"ra": report(a), "rb": report(b)}, base, "x@2")
    s = win.summary()
    assert s["requests"] == 7 and s["errors"] == 1 and s["per_replica_requests"] == {"ra": 4, "rb": 3}
    assert s["mean_completion_tokens"] == pytest.approx((4 * 6 + 2 * 12) / 6)
    assert s["finish_reasons"] == {"length": pytest.approx(2 / 6), "stop": pytest.approx(4 / 6)}
    assert s["ttft_p50_s"] == pytest.approx(LATENCY_BOUNDS[bucket_of(0.05)], rel=1e-5)


def test_a_replica_that_restarted_never_counts_negative():
    clock = Clock()
    a = VersionStats(clock)
    serve(a, clock, "x@1", 5)
    base = baseline({"ra": report(a)}, ["x@1"])
    fresh = VersionStats(clock)  # same id, counters from zero
    serve(fresh, clock, "x@1", 2)
    assert window({"ra": report(fresh)}, base, "x@1").requests == 0


def _win(stats_fn, drafted=0, accepted=0) -> Window:
    clock = Clock()
    st = VersionStats(clock)
    stats_fn(st, clock)
    return window({"r": report(st, {"k@1": (drafted, accepted)})}, {}, "k@1")


GOOD = lambda st, c: serve(st, c, "k@1", 20)  # noqa: E731
CASES = [  # (name of the check that fails, canary's traffic, canary's drafts)
    (None, GOOD, (100, 90)),
    ("error_rate", lambda st, c: (serve(st, c, "k@1", 18), serve(st, c, "k@1", 2, status=500)), (100, 90)),
    ("refusal_rate", lambda st, c: (serve(st, c, "k@1", 17), serve(st, c, "k@1", 3, status=400)), (100, 90)),
    ("ttft_p50_s", lambda st, c: serve(st, c, "k@1", 20, ttft=0.5), (100, 90)),
    ("ttft_p99_s", lambda st, c: (serve(st, c, "k@1", 19), serve(st, c, "k@1", 1, ttft=2.0)), (100, 90)),
    ("tpot_p50_s", lambda st, c: serve(st, c, "k@1", 20, tpot=0.2), (100, 90)),
    ("output_length_max", lambda st, c: serve(st, c, "k@1", 20, tokens=30), (100, 90)),
    ("output_length_min", lambda st, c: serve(st, c, "k@1", 20, tokens=2), (100, 90)),
    ("finish_reason_shift", lambda st, c: (serve(st, c, "k@1", 12), serve(st, c, "k@1", 8, finish="length")),
     (100, 90)),
    ("draft_acceptance_min", GOOD, (100, 30)),
]


@pytest.mark.parametrize("failing,canary_fn,drafts", CASES)
def test_each_threshold_fails_the_canary_it_should_and_only_it(failing, canary_fn, drafts):
    stable, canary = _win(GOOD, 100, 92), _win(canary_fn, *drafts)
    checks = judge(Thresholds(), canary, stable)
    failed = {c.name for c in checks if not c.passed}
    if failing is None:
        assert not failed and {c.name for c in checks} >= {"error_rate", "ttft_p99_s", "draft_acceptance_min",
                                                            "draft_acceptance_max"}
    else:
        assert failing in failed
        assert failed <= {failing, "output_length_max", "output_length_min", "tpot_p99_s", "ttft_p99_s"}


@pytest.mark.parametrize("canary_drafts,failing", [((100, 72), None), ((100, 50), "draft_acceptance_min"),
                                                   ((100, 100), "draft_acceptance_max")])
def test_draft_acceptance_is_held_to_the_stable_versions_either_way(canary_drafts, failing):
    """SmolLM2's shout: the base accepts 0.71 of its drafts; shout with B x 40 repeats one word, which the base
    drafts perfectly (1.0): acceptance that rises is an answer that changed too."""
    checks = judge(Thresholds(), _win(GOOD, *canary_drafts), _win(GOOD, 100, 71))
    failed = {c.name for c in checks if not c.passed}
    assert {"draft_acceptance_min", "draft_acceptance_max"} <= {c.name for c in checks}
    assert failed == ({failing} if failing else set())
    assert not {c.name for c in judge(Thresholds(max_acceptance_rise=1), _win(GOOD, 100, 100), _win(GOOD, 100, 71))
                if not c.passed}


def test_acceptance_is_compared_only_with_enough_drafts_and_a_window_says_what_it_was_not_judged_on():
    t = Thresholds(min_drafted_tokens=50)
    canary, stable = _win(GOOD, 10, 0), _win(GOOD, 100, 90)
    checks = judge(t, canary, stable)
    assert not {"draft_acceptance_min", "draft_acceptance_max"} & {c.name for c in checks}
    missing = not_compared(t, canary, stable, checks)
    assert set(missing) == {"draft_acceptance_min", "draft_acceptance_max"}
    assert "canary 10, stable 100" in missing["draft_acceptance_max"]
    assert {c.name for c in checks} | set(missing) == set(CHECKS)
    assert not not_compared(Thresholds(), canary, stable, judge(Thresholds(min_drafted_tokens=10), canary, stable))


def test_the_window_closes_on_requests_and_seconds_together():
    policy = RolloutPolicy(window_requests=5, window_s=10, min_stable_requests=3)
    five, three = _win(lambda st, c: serve(st, c, "k@1", 5)), _win(lambda st, c: serve(st, c, "k@1", 3))
    assert not window_closed(policy, five, three, 9.9)
    assert not window_closed(policy, three, five, 11)
    assert window_closed(policy, five, three, 10)


def test_a_window_that_requires_the_acceptance_stays_open_until_both_versions_drafted_enough():
    """With require_draft_acceptance a window full of requests waits for min_drafted_tokens drafts of each version
    (the gate may draft little), so a version is never passed without its acceptance compared; without it, it closes
    and is judged on the rest."""
    required = RolloutPolicy(window_requests=5, window_s=0, min_stable_requests=3,
                             thresholds={"min_drafted_tokens": 8, "require_draft_acceptance": True})
    lenient = RolloutPolicy(window_requests=5, window_s=0, min_stable_requests=3, thresholds={"min_drafted_tokens": 8})
    five = lambda st, c: serve(st, c, "k@1", 5)  # noqa: E731
    few, enough = _win(five, 7, 1), _win(five, 8, 1)
    assert window_closed(lenient, few, enough, 0) and window_closed(lenient, enough, few, 0)
    assert not window_closed(required, few, enough, 0) and not window_closed(required, enough, few, 0)
    assert window_closed(required, enough, enough, 0)
    assert not window_closed(required, _win(lambda st, c: serve(st, c, "k@1", 4), 100, 90), enough, 0)  # requests too
    checks = judge(required.thresholds, enough, _win(five, 8, 8))
    assert {c.name for c in checks if not c.passed} == {"draft_acceptance_min"}


@pytest.mark.parametrize("policy", [
    {"steps": [0.5, 0.25]}, {"steps": [0.0, 0.5]}, {"steps": [0.5, 1.0]}, {"steps": []},
    {"thresholds": {"ttft_p99_ratio": 0.9}}, {"thresholds": {"max_error_rate_increase": 1.5}},
    {"thresholds": {"latency_slack_s": -1}}, {"thresholds": {"max_acceptance_rise": 1.5}},
    {"window_requests": 0, "window_s": 0},
    {"window_s": 7200, "step_timeout_s": 3600}, {"thresholds": {"no_such_threshold": 1}},
    {"window_requests": "10"},
])
def test_impossible_policies_are_refused(policy):
    with pytest.raises(ValueError):
        RolloutPolicy.model_validate(policy)


@pytest.mark.parametrize("golden,answer,passes", [
    ({"prompt": "p", "exact": "HELLO"}, "HELLO", True),
    ({"prompt": "p", "exact": "HELLO"}, "HELLO ", False),
    ({"prompt": "p", "regex": "^[A-Z !]+$"}, "HELLO THERE!", True),
    ({"prompt": "p", "regex": "^[A-Z !]+$"}, "hello", False),
    ({"messages": [{"role": "user", "content": "p"}], "json_schema": {"type": "object", "required": ["a"]}},
     '{"a": 1}', True),
    ({"prompt": "p", "json_schema": {"type": "object", "required": ["a"]}}, '{"b": 1}', False),
    ({"prompt": "p", "json_schema": {"type": "object"}}, "not json", False),
])
def test_golden_prompt_checks(golden, answer, passes):
    assert (golden_failure(GoldenPrompt.model_validate(golden), answer) is None) == passes


@pytest.mark.parametrize("golden", [{"prompt": "p"}, {"prompt": "p", "exact": "a", "regex": "a"},
                                    {"exact": "a"}, {"prompt": "p", "regex": "("},
                                    {"prompt": "p", "json_schema": {"type": "nonsense"}}])
def test_malformed_golden_prompts_are_refused(golden):
    with pytest.raises(ValueError):
        GoldenPrompt.model_validate(golden)
