"""bench/prefix_load.py as a user runs it, on the CPU with the tiny shape: chat traffic and its unshared control,
each with prefix caching off and on over two repeats in alternating order, served to the end with equal outputs;
the chat traffic hits the cache and the control never does. And the traffic itself: a session's turns resend its
history."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.prefix_load import ChatConfig, chat_traffic  # noqa: E402


def test_a_session_resends_its_system_prompt_and_history_and_the_control_shares_nothing():
    cfg = ChatConfig(adapters=("a", "b"), system_len=20, sessions=8, turns=3, user_len=(2, 4), answer_len=(3, 5),
                     popularity="uniform", vocab=100)
    chat, control = chat_traffic(cfg), chat_traffic(cfg, shared=False)
    assert [(r.request_id, r.arrival, len(r.prompt), r.adapter) for r in chat] == \
           [(r.request_id, r.arrival, len(r.prompt), r.adapter) for r in control]
    turns = {r.request_id: r for r in chat}
    for s in range(8):
        first, second, third = (turns[f"s{s}t{t}"] for t in range(3))
        assert second.prompt[:len(first.prompt)] == first.prompt and third.prompt[:len(second.prompt)] == second.prompt
        assert abs(second.arrival - first.arrival - cfg.think_s) < 1e-9
    system = {r.adapter: r.prompt[:20] for r in chat}
    assert all(r.prompt[:20] == system[r.adapter] for r in chat) and system["a"] != system["b"]
    assert len({tuple(r.prompt[:20]) for r in control}) == len(control)


def test_caching_off_and_on_serve_the_same_tokens_and_only_shared_prefixes_hit(tmp_path):
    out = tmp_path / "prefix.json"
    cmd = [sys.executable, str(ROOT / "bench" / "prefix_load.py"), "--device", "cpu", "--shape", "tiny",
           "--adapters", "3", "--max-loras", "3", "--rank", "8", "--system-len", "48", "--sessions", "6",
           "--turns", "2", "--session-rate", "4", "--think-s", "1.0", "--user-len", "4", "8", "--answer-len", "4", "6",
           "--cpu-threads", "1", "--warmup-sessions", "1", "--work-dir", str(tmp_path), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert json.loads(out.read_text()) == result
    # two repeats a traffic, in alternating order, each with the speculation counters of its own run
    assert [(r["traffic"], r["repeat"], r["caching"]) for r in result["runs"]] == [
        (t, i, c) for t in ("chat", "unshared") for i, cs in enumerate([(False, True), (True, False)]) for c in cs]
    assert all(sum(r["speculation"]["gate_decisions"].values()) > 0 for r in result["runs"])
    runs = {(r["traffic"], r["caching"]): r for r in result["runs"]}
    assert len(runs) == 4
    for run in runs.values():
        assert run["finished"] == 12 and run["free_kv_blocks_after"] and run["ttft_ms"]["p50"] is not None
    assert runs[("chat", True)]["prefix_hit_rate"] > 0.3 and runs[("unshared", True)]["prefix_hit_rate"] == 0.0
    rows = {row["traffic"]: row for row in result["compare"]}
    assert rows["chat"]["outputs_equal"] and rows["unshared"]["outputs_equal"]
    assert rows["chat"]["on_over_off_ttft_p50"] > 0 and rows["unshared"]["on_over_off_tpot_p50"] > 0
    assert rows["chat"]["repeats"] == rows["unshared"]["repeats"] == 2
