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
