"""bench/serve_load.py as a user runs it, on the CPU with the tiny shape: every mode serves the same open-loop
traffic to the end, plain, gated and forced drafting give the same outputs (base-only traffic does not), and the
comparison rows carry the ratios the RESULTS table reports."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REQUESTS = 16


def test_every_mode_serves_the_same_traffic_and_drafting_is_lossless(tmp_path):
    out = tmp_path / "load.json"
    cmd = [sys.executable, str(ROOT / "bench" / "serve_load.py"), "--device", "cpu", "--shape", "tiny",
           "--adapters", "6", "--max-loras", "4", "--rank", "8", "--requests", str(REQUESTS), "--runs", "poisson:50",
           "--modes", "base", "plain", "gated", "forced", "--prompt-len", "8", "24", "--output-len", "4", "16",
           "--cpu-threads", "1", "--work-dir", str(tmp_path), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert json.loads(out.read_text()) == result
    runs = {r["mode"]: r for r in result["runs"]}
    assert sorted(runs) == ["base", "forced", "gated", "plain"]
    for mode, run in runs.items():
        assert "crash" not in run, (mode, run.get("crash"))
        assert run["finished"] == REQUESTS and run["free_kv_blocks_after"], (mode, run)
        assert run["ttft_ms"]["p50"] is not None and run["tokens_per_s"] > 0
    # identical traffic: plain, gated and forced decode the same tokens; the base model alone decodes others
    assert runs["gated"]["outputs"] == runs["plain"]["outputs"] == runs["forced"]["outputs"]
    assert runs["base"]["outputs"] != runs["plain"]["outputs"]
    assert runs["forced"]["cycles"] > 0 and runs["forced"]["drafted_tokens"] > 0
    assert 0.0 <= runs["forced"]["acceptance"] <= 1.0
    assert runs["plain"].get("cycles") is None  # speculation off: no cycle counters
    [row] = result["compare"]
    assert row["run"] == "poisson:50" and row["outputs_equal_plain"] is True
    for key in ("gated_over_base_tput", "gated_over_plain_ttft_p50", "gated_over_plain_tpot_p99", "gated_over_best_tput"):
        assert row[key] > 0, key


def test_the_served_loops_replay_the_same_traffic_to_the_same_outputs(tmp_path):
    """`--loop served` and `--loop core` (AsyncLLMEngine, an asyncio client per request; its core on a thread, or in
    a process of its own as a replica runs it, the modes switched there) decode what the step loop does on the same
    traffic, every request to its end."""
    def run(loop: str) -> dict:
        cmd = [sys.executable, str(ROOT / "bench" / "serve_load.py"), "--device", "cpu", "--shape", "tiny",
               "--adapters", "4", "--max-loras", "2", "--rank", "8", "--requests", "12", "--runs", "burst",
               "--modes", "plain", "forced", "--prompt-len", "8", "24", "--output-len", "4", "16",
               "--cpu-threads", "1", "--work-dir", str(tmp_path), "--loop", loop]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout)

    step = run("step")
    assert step["loop"] == "step"
    for loop in ("served", "core"):
        served = run(loop)
        assert served["loop"] == loop
        for mode in ("plain", "forced"):
            s = next(r for r in served["runs"] if r["mode"] == mode)
            assert "crash" not in s and s["finished"] == 12 and s["free_kv_blocks_after"], (loop, s)
            assert s["ttft_ms"]["p50"] is not None and s["tokens_per_s"] > 0
            assert s["outputs"] == next(r for r in step["runs"] if r["mode"] == mode)["outputs"], loop
        forced = next(r for r in served["runs"] if r["mode"] == "forced")
        assert forced["cycles"] > 0, (loop, forced)  # the mode was switched in the core
