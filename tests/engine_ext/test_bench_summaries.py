"""The benchmarks' pure helpers: serve_load's mode names (a drafting mode with its own draft lead) and gpu_busy's
summaries of a profile (the union of kernel intervals, the idle gaps between them, the kernels that took longest)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from engine_ext.profiling import idle_gaps, kernel_union_seconds, top_kernels  # noqa: E402
from bench.serve_load import mode_spec, parse_mode  # noqa: E402


@pytest.mark.parametrize("mode,parsed", [("base", ("base", None)), ("plain", ("plain", None)),
                                         ("gated", ("gated", None)), ("gated@3", ("gated", 3)),
                                         ("forced@0", ("forced", 0))])
def test_modes_parse(mode, parsed):
    assert parse_mode(mode) == parsed


@pytest.mark.parametrize("mode", ["plain@2", "base@1", "gated@", "gated@x", "sampled", "gated@-1"])
def test_bad_modes_are_refused(mode):
    with pytest.raises(ValueError, match="mode must be one of"):
        parse_mode(mode)


def test_a_mode_with_a_lead_overrides_the_runs_lead():
    assert mode_spec("plain", 4, 2) is None
    assert mode_spec("gated", 4, 2).draft_lead == 2
    spec = mode_spec("gated@3", 4, 2)
    assert spec.draft_lead == 3 and spec.gate and spec.num_draft_tokens == 4
    assert not mode_spec("forced@0", 4).gate and mode_spec("forced@0", 4).draft_lead == 0


def test_idle_gaps_are_the_holes_in_the_union_by_size():
    us = 1000  # ns
    kernels = [(0, 10 * us), (5 * us, 12 * us), (15 * us, 20 * us), (60 * us, 70 * us), (3070 * us, 3080 * us)]
    assert kernel_union_seconds(kernels) == pytest.approx(37e-6)
    gaps = idle_gaps(kernels)
    assert gaps["5"] == {"count": 1, "ms": 0.003}  # 12 -> 15 us
    assert gaps["100"] == {"count": 1, "ms": 0.04}  # 20 -> 60 us
    assert gaps["inf"] == {"count": 1, "ms": 3.0}  # 70 -> 3070 us
    assert gaps["20"]["count"] == gaps["500"]["count"] == gaps["2000"]["count"] == 0


def test_top_kernels_rank_names_by_total_time():
    events = [("gemm", 0, 500), ("norm", 0, 100), ("gemm", 0, 700), ("norm", 0, 100), ("tiny", 0, 10)]
    top = top_kernels(events, n=2)
    assert [r["kernel"] for r in top] == ["gemm", "norm"]
    assert top[0] == {"kernel": "gemm", "count": 2, "ms": 0.001, "mean_us": 0.6}


def _run(run, mode, tpot, ttft, tok_s, **extra):
    return {"run": run, "mode": mode, "tpot_ms": {"p50": tpot[0], "p99": tpot[1]}, "ttft_ms": {"p50": ttft},
            "tokens_per_s": tok_s, **extra}


def test_the_load_table_reads_issue_41s_bars_and_the_burst_bound(tmp_path):
    """bench/load_table.py: the ratios against base-only and plain, which bars a run misses, the share of cycles,
    the burst bound from the gated run's pass times (interpolated to (k+1) x its largest batch) and the earlier
    tree's file beside it."""
    import json

    from bench.load_table import burst_bound, table

    times = {"base": {"64/0": 2.0, "128/0": 2.5, "128/4": 9.0}, "lora": {"512/32": 4.0, "768/32": 6.0, "512/8": 3.0}}
    new = {"spec": 4, "runs": [
        _run("poisson:30", "base", (1.0, 1.2), 5.0, 100.0), _run("poisson:30", "plain", (1.5, 2.0), 6.0, 99.0),
        _run("poisson:30", "gated", (1.1, 2.3), 6.0, 99.5, cycles=90, plain_steps=10),
        _run("burst", "base", (2.0, 4.0), 100.0, 1000.0), _run("burst", "plain", (3.0, 6.0), 120.0, 700.0),
        _run("burst", "gated", (2.8, 5.0), 110.0, 690.0, cycles=5, plain_steps=15, pass_times_ms=times)]}
    old = {"runs": [_run("poisson:30", m, (t, t), 5.0, 90.0) for m, t in (("base", 1.1), ("plain", 2.5))]}
    (tmp_path / "lightload-x.json").write_text(json.dumps(new))
    (tmp_path / "lightload-x-ab-old.json").write_text(json.dumps(old))
    rows = table([str(tmp_path / "lightload-x.json"), str(tmp_path / "lightload-x-ab-old.json")])
    light, burst = rows
    assert light["gated_over_base_tpot_p50"] == 1.1 and light["gated_over_plain_tpot_p99"] == 1.15
    assert light["missed"] == ["gated_over_plain_tpot_p99"] and light["cycle_share"] == 0.9
    assert light["earlier_tpot_p50_ms"] == [1.1, 2.5, None]
    # V at 5 x 128 = 640 tokens: halfway between 512 (4.0, the slowest there) and 768 (6.0)
    assert burst["bound"] == {"batch": 128, "base_ms": 2.5, "verify_ms": 5.0, "bound": round(12.5 / 15.0, 3)}
    assert burst["gated_over_plain_tput"] == round(690 / 700, 3)
    assert burst["missed"] == ["gated_over_plain_tput", "bound"]  # 0.69 of base-only, under 0.9 x 0.833
    assert burst_bound({"base": {}, "lora": {}}, 4) is None
