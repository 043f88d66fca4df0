"""Shared-prefix chat traffic with prefix caching off and on (issue 29), on one engine and identical arrivals.

    python bench/prefix_load.py --device cpu --shape tiny --system-len 96 --sessions 12 --cpu-threads 1  # a CPU
    python bench/prefix_load.py --shape llama-3.2-1b                                                     # the H200
    python bench/prefix_load.py --shape llama-3.1-8b --session-rate 2

Traffic ("chat"): `--adapters` adapters, each with its own `--system-len`-token system prompt; sessions start as a
Poisson process (`--session-rate` per second), each on one adapter (Zipf popularity) for `--turns` turns
`--think-s` apart. Turn t's prompt is the system prompt, then every earlier turn's user message and answer, then its
own user message: what a chat client resends. The earlier answers are drawn with the traffic (not the model's
tokens, which are not known when the arrivals are drawn), so the blocks reused are the system prompt and the
earlier turns' prompts, never a decoded answer's: a real client resending the real answers reuses more.

Control ("unshared"): the same arrivals, adapters and lengths, every prompt fresh random tokens, so nothing can
be reused: caching on must cost it nothing (the issue: within 5% of off).

Each traffic runs `--repeats` pairs of runs, caching off and on, on the same engine (`LLMEngine.set_prefix_caching`;
every run starts with an empty cache), the pairs in alternating order (off then on, on then off, ...) so that what
one run leaves behind (the gate's measurements, the allocator's state) weighs on both settings alike. Prints one
JSON object (bench/serve_load.py's conventions: per run tokens/s, TTFT and TPOT percentiles, finish reasons, an
output digest), each run with the prefix cache's hit rate and the speculation counters (gate decisions, cycles,
plain steps: a difference the gate made between two runs shows there), and `compare`: per traffic, on over off for
the medians over the repeats of TTFT p50/p99, TPOT p50 and throughput, and whether every run's outputs were equal
(greedy: they must be).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from statistics import median

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.serve_load import (WallClock, build_workload, engine_config, outputs_digest, replay,  # noqa: E402
                              summarize)
from bench.traffic import Request, popularity_weights  # noqa: E402

TRAFFICS = ("chat", "unshared")


@dataclass(frozen=True)
class ChatConfig:
    adapters: tuple[str, ...]
    system_len: int = 1000
    sessions: int = 40
    turns: int = 3
    session_rate: float = 4.0  # sessions started per second (Poisson)
    think_s: float = 1.0  # between a session's turns
    user_len: tuple[int, int] = (32, 96)
    answer_len: tuple[int, int] = (32, 64)  # each turn's max_tokens, and the drawn answer a later turn resends
    popularity: str = "zipf:1.0"
    vocab: int = 32000
    seed: int = 0


def chat_traffic(cfg: ChatConfig, shared: bool = True) -> list[Request]:
    """Every turn of every session as a request, in arrival order. shared=False: the same arrivals, adapters and
    lengths with every prompt drawn fresh (the control). Pure and seeded."""
    rng, fresh = random.Random(cfg.seed), random.Random(cfg.seed + 1)  # (fresh: the control's prompts)
    draw = lambda n, r=rng: [r.randrange(1, cfg.vocab) for _ in range(n)]  # noqa: E731
    systems = {a: draw(cfg.system_len) for a in cfg.adapters}
    weights = popularity_weights(cfg.popularity, len(cfg.adapters))
    out, start = [], 0.0
    for s in range(cfg.sessions):
        start += rng.expovariate(cfg.session_rate)
        adapter = rng.choices(cfg.adapters, weights)[0]
        history = list(systems[adapter])
        for t in range(cfg.turns):
            history += draw(rng.randint(*cfg.user_len))
            answer = rng.randint(*cfg.answer_len)
            prompt = list(history) if shared else draw(len(history), fresh)
            out.append(Request(f"s{s}t{t}", start + t * cfg.think_s, prompt, answer, adapter))
            history += draw(answer)
    return sorted(out, key=lambda r: r.arrival)


def compare(runs: list[dict]) -> list[dict]:
    """Per traffic: caching on over off for the medians over its repeats (TTFT p50 and p99, TPOT p50, throughput),
    and whether every run's outputs were equal."""
    rows = []
    for traffic in TRAFFICS:
        mine = [r for r in runs if r["traffic"] == traffic and "crash" not in r]
        off, on = ([r for r in mine if r["caching"] is c] for c in (False, True))
        if not (off and on):
            continue

        def mid(rs, key, q):
            values = [r[key][q] if q else r[key] for r in rs]
            return None if any(v is None for v in values) else median(values)

        ratio = lambda key, q=None: (round(mid(on, key, q) / mid(off, key, q), 3)  # noqa: E731
                                     if mid(on, key, q) is not None and mid(off, key, q) else None)
        rows.append({"traffic": traffic, "repeats": min(len(off), len(on)),
                     "on_over_off_ttft_p50": ratio("ttft_ms", "p50"), "on_over_off_ttft_p99": ratio("ttft_ms", "p99"),
                     "on_over_off_tpot_p50": ratio("tpot_ms", "p50"), "on_over_off_tput": ratio("tokens_per_s"),
                     "hit_rate": median(r["prefix_hit_rate"] for r in on),
                     "outputs_equal": len({r["outputs"] for r in mine}) == 1})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--adapters", type=int, default=20)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-loras", type=int, default=32)
    ap.add_argument("--max-rank", type=int, default=64)
    ap.add_argument("--spec", type=int, default=4, help="draft tokens, the gate deciding (0: plain multi-LoRA)")
    ap.add_argument("--system-len", type=int, default=1000)
    ap.add_argument("--sessions", type=int, default=40)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--session-rate", type=float, default=4.0)
    ap.add_argument("--think-s", type=float, default=1.0)
    ap.add_argument("--user-len", type=int, nargs=2, default=[32, 96])
    ap.add_argument("--answer-len", type=int, nargs=2, default=[32, 64])
    ap.add_argument("--popularity", default="zipf:1.0")
    ap.add_argument("--traffics", nargs="+", choices=TRAFFICS, default=list(TRAFFICS))
    ap.add_argument("--kv-cache-gb", type=float, default=None, help="KV cache size (default: the benchmarks' 24 GiB)")
    ap.add_argument("--cpu-threads", type=int, default=None)
    ap.add_argument("--work-dir", default=os.environ.get("BENCH_DIR") or tempfile.gettempdir())
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2,
                    help="pairs of runs (caching off and on) per traffic, in alternating order")
    ap.add_argument("--warmup-sessions", type=int, default=4,
                    help="sessions of chat traffic replayed unrecorded first, caching off then on (first-use costs)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    from bench.common import SHAPES, machine, spec_delta
    from engine_ext import LLMEngine, SamplingParams, SpecConfig

    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    gpu = args.device.startswith("cuda")
    # near adapters (the serve_load "near" mix): drafting pays, as it does for most tenants
    model_dir, adapters = build_workload(args.work_dir, args.shape, args.adapters, args.rank, gpu, (0.1,))
    spec = SpecConfig(num_draft_tokens=args.spec) if args.spec else None
    max_len = args.system_len + args.turns * (args.user_len[1] + args.answer_len[1]) + 64
    engine = LLMEngine(engine_config(model_dir, args.device, args.adapters, args.max_loras, args.rank, args.max_rank,
                                     spec, max_model_len=max(2048, max_len),
                                     **({} if args.kv_cache_gb is None else {"kv_cache_memory_gb": args.kv_cache_gb})))
    for name, path in adapters.items():
        engine.add_adapter(name, path)
    gc.collect()
    gc.freeze()
    chat = ChatConfig(tuple(adapters), args.system_len, args.sessions, args.turns, args.session_rate, args.think_s,
                      tuple(args.user_len), tuple(args.answer_len), args.popularity, SHAPES[args.shape][5], args.seed)
    result = {"machine": machine(), "shape": args.shape, "spec": args.spec, "chat": {
        k: v for k, v in vars(chat).items() if k != "adapters"} | {"adapters": args.adapters},
        "startup": engine.stats()["startup"], "runs": []}

    def params_for(r: Request):
        return SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)

    print("startup", json.dumps(result["startup"]), file=sys.stderr, flush=True)
    if args.warmup_sessions:  # other seeds: nothing of it is cached for the measured runs
        warm = dataclasses.replace(chat, sessions=args.warmup_sessions, seed=args.seed + 1000)
        for caching in (False, True):
            engine.set_prefix_caching(caching)
            replay(engine, chat_traffic(warm), WallClock(), params_for)
        print("warmed up", file=sys.stderr, flush=True)

    traffics = {traffic: chat_traffic(chat, shared=traffic == "chat") for traffic in args.traffics}
    order = [(traffic, i, caching) for traffic in args.traffics for i in range(args.repeats)
             for caching in ((False, True) if i % 2 == 0 else (True, False))]
    for traffic, repeat, caching in order:
        requests = traffics[traffic]
        engine.set_prefix_caching(caching)
        run = {"traffic": traffic, "caching": caching, "repeat": repeat,
               "prompt_tokens": sum(len(r.prompt) for r in requests)}
        before = engine.stats()
        preempted = before["num_preemptions"]
        start = time.perf_counter()
        records = replay(engine, requests, WallClock(), params_for)
        run |= summarize(records, time.perf_counter() - start)
        run["outputs"] = outputs_digest(records)
        stats = engine.stats()
        run["speculation"] = spec_delta(before, stats)
        cache = stats.get("prefix_cache") or {}
        run["prefix_hit_rate"] = cache.get("hit_rate")
        run["prefix_hits"], run["prefix_queries"] = cache.get("hits"), cache.get("queries")
        run["preemptions"] = stats["num_preemptions"] - preempted
        run["free_kv_blocks_after"] = stats["free_kv_blocks"] == stats["total_kv_blocks"]
        result["runs"].append(run)
        _write(args.out, result)  # after every run: a run cut off by a time limit keeps the ones before
        print("run", json.dumps({k: run.get(k) for k in (
            "traffic", "caching", "repeat", "finished", "seconds", "tokens_per_s", "ttft_ms", "tpot_ms",
            "prefix_hit_rate")} | {"gate": run["speculation"].get("gate_decisions")}), file=sys.stderr)
    result["compare"] = compare(result["runs"])
    for row in result["compare"]:
        print("compare", json.dumps(row), file=sys.stderr)
    _write(args.out, result)
    print(json.dumps(result, indent=1))


def _write(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            f.write(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
