"""Open-loop load on the engine's step loop: requests arrive on their own schedule (bench/traffic.py), not when
the previous ones finish, and each one's first-token and inter-token times are measured as a user sees them.

    python bench/serve_load.py --device cpu --shape tiny --requests 40 --runs poisson:20          # a CPU
    python bench/serve_load.py --shape llama-3.1-8b --runs poisson:10 poisson:25 burst --spec 4   # the H200
    python bench/serve_load.py --shape llama-3.2-1b --spec 0 --compile-cache /tmp/empty           # cold start

Prints one JSON object: the engine's start-up seconds, then per run tokens/s, TTFT and TPOT percentiles,
finish reasons, errors, the gate's decisions and the Triton kernels compiled after the engine reported ready
(files added to --compile-cache while serving; 0 when the warm-up covered every variant).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import percentile  # noqa: E402
from bench.traffic import Request, TrafficConfig, generate  # noqa: E402


@dataclass
class Record:
    """One request's life on the clock of the replay."""

    request: Request
    added: float | None = None  # when the engine got it (its arrival, unless the loop was late)
    token_times: list[float] = field(default_factory=list)  # when each batch of new tokens came back
    token_counts: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.request.arrival if self.token_times else None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        n = len(self.token_ids)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    def gaps(self) -> list[float]:
        """Inter-token latency of each token after the first (a batch of k tokens at once: its gap over k)."""
        out = []
        for i in range(1, len(self.token_times)):
            k = self.token_counts[i]
            out += [(self.token_times[i] - self.token_times[i - 1]) / k] * k
        return out


class WallClock:
    """Real time since the start; an idle engine sleeps until the next arrival."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.start

    def idle_until(self, t: float) -> None:
        time.sleep(max(0.0, t - self.now()))

    def stepped(self) -> None:
        pass


class StepClock:
    """Simulated time: each engine step takes `dt` seconds; an idle engine jumps to the next arrival. Makes a
    replay deterministic (tests), while arrivals still land between and during decoding."""

    def __init__(self, dt: float = 0.01) -> None:
        self.dt, self.t = dt, 0.0

    def now(self) -> float:
        return self.t

    def idle_until(self, t: float) -> None:
        self.t = max(self.t, t)

    def stepped(self) -> None:
        self.t += self.dt


def replay(engine, requests: list[Request], clock, params_for, max_steps: int | None = None,
           sync=lambda: None) -> list[Record]:
    """Drive `engine.step()` under open-loop arrivals: before each step, add every request that has arrived and
    abort those past their `abort_after`. `params_for(request)` gives its SamplingParams. A request the engine
    refuses is recorded with its error, not raised. Returns one record per request, in arrival order."""
    records = {r.request_id: Record(r) for r in requests}
    pending = list(requests)
    live: set[str] = set()
    steps = 0
    while pending or live:
        if not live and pending:
            clock.idle_until(pending[0].arrival)
        now = clock.now()
        while pending and pending[0].arrival <= now:
            r = pending.pop(0)
            rec = records[r.request_id]
            rec.added = now
            try:
                engine.add_request(r.request_id, prompt_token_ids=r.prompt, sampling_params=params_for(r),
                                   adapter_name=r.adapter)
                live.add(r.request_id)
            except ValueError as exc:
                rec.error, rec.finish_reason = str(exc), "error"
        for rid in list(live):
            rec = records[rid]
            if rec.request.abort_after is not None and len(rec.token_ids) >= rec.request.abort_after:
                engine.abort_request(rid)
        outs = engine.step()
        sync()
        clock.stepped()
        now = clock.now()
        for out in outs:
            rec = records[out.request_id]
            if out.new_token_ids:
                rec.token_times.append(now)
                rec.token_counts.append(len(out.new_token_ids))
                rec.token_ids += out.new_token_ids
            if out.finished:
                rec.finish_reason = out.finish_reason
                live.discard(out.request_id)
        steps += 1
        if max_steps is not None and steps >= max_steps:
            break
    return [records[r.request_id] for r in requests]


def summarize(records: list[Record], seconds: float) -> dict:
    done = [r for r in records if r.finish_reason not in (None, "error")]
    ttft = [r.ttft for r in done if r.ttft is not None]
    tpot = [r.tpot for r in done if r.tpot is not None]
    gaps = [g for r in done for g in r.gaps()]
    tokens = sum(len(r.token_ids) for r in records)
    reasons: dict[str, int] = {}
    for r in records:
        reasons[str(r.finish_reason)] = reasons.get(str(r.finish_reason), 0) + 1
    ms = lambda v: None if v is None else round(v * 1e3, 2)  # noqa: E731
    return {
        "requests": len(records), "finished": len(done), "finish_reasons": reasons,
        "errors": [r.error for r in records if r.error][:5], "seconds": round(seconds, 2),
        "output_tokens": tokens, "tokens_per_s": round(tokens / seconds, 1) if seconds else None,
        "ttft_ms": {"p50": ms(percentile(ttft, 0.5)), "p99": ms(percentile(ttft, 0.99)), "max": ms(max(ttft, default=None))},
        "tpot_ms": {"p50": ms(percentile(tpot, 0.5)), "p99": ms(percentile(tpot, 0.99))},
        "itl_p99_ms": ms(percentile(gaps, 0.99)),
    }


MIXED_SCALES = (0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 1.0, 1.0, 1.0, 1.0, 2.0, 100.0)  # half near, a third mid, far


def build_workload(work_dir: str, shape: str, num_adapters: int, rank: int, gpu: bool,
                   scales: tuple[float, ...] = MIXED_SCALES) -> tuple[str, dict[str, str]]:
    """A random model of `shape` (on a GPU: bf16 with a peaked next-token distribution, see
    bench.decode.build_model_on_gpu) and `num_adapters` rank-`rank` adapters on all seven projections at mixed
    distances from the base (adapter i at scales[i % len(scales)], so acceptance varies by adapter). Built
    once under `work_dir` and reused."""
    import torch

    from bench.common import build_random_adapter, build_random_model

    model_dir = os.path.join(work_dir, f"serve-load-{shape}")
    if gpu:
        from bench.decode import build_model_on_gpu

        build_model_on_gpu(model_dir, shape, residual_scale=0.001)
    else:
        build_random_model(model_dir, shape, dtype=torch.float32)
    adapters = {}
    for i in range(num_adapters):
        scale = scales[i % len(scales)]
        path = os.path.join(work_dir, f"serve-load-{shape}-r{rank}-s{scale:g}-{i}")
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            build_random_adapter(path, shape, rank, seed=i, scale=scale,
                                 dtype=torch.bfloat16 if gpu else torch.float32)
        adapters[f"a{i:03d}"] = path
    return model_dir, adapters


def _cache_entries(path: str | None) -> int | None:
    return len(os.listdir(path)) if path and os.path.isdir(path) else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--adapters", type=int, default=48)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-loras", type=int, default=32)
    ap.add_argument("--max-rank", type=int, default=64, help="slot rank (EngineConfig.max_lora_rank's default)")
    ap.add_argument("--spec", type=int, default=4, help="draft tokens (0: plain multi-LoRA)")
    ap.add_argument("--no-gate", action="store_true")
    ap.add_argument("--runs", nargs="+", default=["poisson:10"],
                    help="one run each, on one engine: poisson:RATE, gamma:RATE:CV or burst")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--popularity", default="zipf:1.0")
    ap.add_argument("--base-share", type=float, default=0.2)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[64, 512])
    ap.add_argument("--output-len", type=int, nargs=2, default=[32, 256])
    ap.add_argument("--compile-cache", default=None, help="Triton cache dir (an empty one: a cold start)")
    ap.add_argument("--debug-checks", action="store_true")
    ap.add_argument("--work-dir", default=os.environ.get("BENCH_DIR") or tempfile.gettempdir())
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    from bench.common import SHAPES, machine
    from engine_ext import EngineConfig, LLMEngine, SamplingParams, SpecConfig

    gpu = args.device.startswith("cuda")
    model_dir, adapters = build_workload(args.work_dir, args.shape, args.adapters, args.rank, gpu)
    spec = SpecConfig(num_draft_tokens=args.spec, gate=not args.no_gate) if args.spec else None
    fast = dict(lora_backend="triton", attn_backend="triton", layer_ops="triton", cuda_graphs=True,
                max_graph_tokens=512, kv_cache_memory_gb=24) if gpu else dict(num_kv_blocks=4096)
    cfg = EngineConfig(model=model_dir, device=args.device, dtype="bfloat16" if gpu else "float32",
                       max_loras=args.max_loras, max_lora_rank=max(args.max_rank, args.rank), max_cpu_loras=max(64, args.adapters),
                       max_num_seqs=128, max_num_batched_tokens=8192, max_model_len=2048, speculative=spec,
                       compile_cache_dir=args.compile_cache, debug_checks=args.debug_checks, **fast)
    before = _cache_entries(args.compile_cache)
    engine = LLMEngine(cfg)
    for n, p in adapters.items():
        engine.add_adapter(n, p)
    ready_entries = _cache_entries(args.compile_cache)
    sync = (lambda: torch.cuda.synchronize()) if gpu else (lambda: None)
    startup = engine.stats()["startup"]
    print("startup", json.dumps(startup), "cache entries", before, "->", ready_entries, file=sys.stderr)
    result = {"machine": machine(), "shape": args.shape, "spec": args.spec, "gate": not args.no_gate,
              "adapters": args.adapters, "max_loras": args.max_loras, "rank": args.rank,
              "startup": startup, "cache_entries_before": before,
              "cache_entries_ready": ready_entries, "runs": []}
    vocab = SHAPES[args.shape][5]
    for i, run_spec in enumerate(args.runs):
        arrival, *nums = run_spec.split(":")
        rate, cv = (float(nums[0]) if nums else 1.0), (float(nums[1]) if len(nums) > 1 else 1.0)
        traffic = TrafficConfig(num_requests=args.requests, arrival=arrival, rate=rate, cv=cv,
                                adapters=tuple(adapters), popularity=args.popularity, base_share=args.base_share,
                                prompt_len=tuple(args.prompt_len), output_len=tuple(args.output_len), vocab=vocab,
                                seed=args.seed + i)
        requests = generate(traffic)
        run = {"run": run_spec}
        start = time.perf_counter()
        try:
            records = replay(engine, requests, WallClock(),
                             lambda r: SamplingParams(max_tokens=r.max_tokens, ignore_eos=True), sync=sync)
            run |= summarize(records, time.perf_counter() - start)
        except Exception as exc:  # a crash is the result: report it, with how far the run got
            run |= {"crash": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:],
                    "seconds": round(time.perf_counter() - start, 2)}
            print("run", json.dumps({"run": run_spec, "crash": run["crash"]}), file=sys.stderr)
            result["runs"].append(run)
            break
        stats = engine.stats()
        run["cache_entries_after"] = _cache_entries(args.compile_cache)
        run["compiled_while_serving"] = (None if ready_entries is None
                                         else run["cache_entries_after"] - ready_entries)
        ready_entries = run["cache_entries_after"]
        if "speculative" in stats:
            run["gate_decisions"] = stats["speculative"]["gate_decisions"]
            run["cycles"], run["plain_steps"] = stats["speculative"]["cycles"], stats["speculative"]["plain_steps"]
        run["preemptions"] = stats["num_preemptions"]
        run["free_kv_blocks_after"] = stats["free_kv_blocks"] == stats["total_kv_blocks"]
        result["runs"].append(run)
        print("run", json.dumps({k: run.get(k) for k in ("run", "finished", "finish_reasons", "seconds", "tokens_per_s",
                                                         "ttft_ms", "tpot_ms", "itl_p99_ms", "compiled_while_serving",
                                                         "cycles", "plain_steps")}), file=sys.stderr)
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
