"""Open-loop load on the engine's step loop: requests arrive on their own schedule (bench/traffic.py), not when
the previous ones finish, and each one's first-token and inter-token times are measured as a user sees them.

    python bench/serve_load.py --device cpu --shape tiny --requests 40 --runs poisson:20          # a CPU
    python bench/serve_load.py --shape llama-3.1-8b --runs poisson:10 poisson:25 burst --spec 4   # the H200
    python bench/serve_load.py --shape llama-3.2-1b --spec 0 --compile-cache /tmp/empty           # cold start
    python bench/serve_load.py --modes base plain gated forced --mix near --runs poisson:30 burst  # modes compared
    python bench/serve_load.py --loop served --runs burst    # through AsyncLLMEngine, its core on a thread
    python bench/serve_load.py --loop core --runs burst      # ... its core in a process of its own, as a replica serves

Every mode (`--modes`) serves every run's traffic: the same arrivals, lengths and adapters (for "base", the same
requests on the base model alone). Prints one JSON object: the engine's start-up seconds, then per mode and run
tokens/s, TTFT and TPOT percentiles, finish reasons, errors, acceptance, the gate's decisions, a digest of the
outputs (equal across plain, gated and forced: drafting is lossless) and the Triton kernels compiled after the
engine reported ready (files added to --compile-cache while serving; 0 when the warm-up covered every
variant); then `compare`, per run, the ratios between modes.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import percentile, spec_delta  # noqa: E402
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

    def took(self, out, now: float) -> None:
        """One output of its stream (a RequestOutput), handed out at `now`."""
        if out.new_token_ids:
            self.token_times.append(now)
            self.token_counts.append(len(out.new_token_ids))
            self.token_ids += out.new_token_ids
        if out.finished:
            self.finish_reason = out.finish_reason

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

    def passed(self) -> None:
        pass


class StepClock:
    """Simulated time: each engine step takes `dt` seconds, and each time a speculative cycle takes arrivals in
    between its passes, `pass_dt` more; an idle engine jumps to the next arrival. Makes a replay deterministic
    (tests), while arrivals still land between and during decoding, and with `pass_dt` during a cycle."""

    def __init__(self, dt: float = 0.01, pass_dt: float = 0.0) -> None:
        self.dt, self.pass_dt, self.t = dt, pass_dt, 0.0

    def now(self) -> float:
        return self.t

    def idle_until(self, t: float) -> None:
        self.t = max(self.t, t)

    def stepped(self) -> None:
        self.t += self.dt

    def passed(self) -> None:
        self.t += self.pass_dt


def replay(engine, requests: list[Request], clock, params_for, max_steps: int | None = None,
           served: bool = False) -> list[Record]:
    """Drive `engine.step()` under open-loop arrivals: before each step, add every request that has arrived and
    abort those past their `abort_after`; during a step, a speculative cycle takes in those that arrive between
    its passes (StepContext.arrivals) and hands out first tokens before it ends (StepContext.publish, recorded at
    that moment), as a serving loop's does. `params_for(request)` gives its SamplingParams. A request the engine
    refuses is recorded with its error, not raised. Returns one record per request, in arrival order.
    `served`: through the loop an LLM replica runs instead (`replay_served`; wall clock only)."""
    from engine_ext import StepContext

    if served:
        return replay_served(engine, requests, params_for)

    records = {r.request_id: Record(r) for r in requests}
    pending = list(requests)
    live: set[str] = set()

    def intake() -> None:
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

    def intake_between_passes() -> None:
        clock.passed()
        intake()

    def record(outs, now: float) -> None:
        for out in outs:
            records[out.request_id].took(out, now)
            if out.finished:
                live.discard(out.request_id)

    # first tokens handed out during a cycle are recorded when they come
    ctx = StepContext(arrivals=intake_between_passes, publish=lambda outs: record(outs, clock.now()))
    steps = 0
    while pending or live:
        if not live and pending:
            clock.idle_until(pending[0].arrival)
        intake()
        for rid in list(live):
            rec = records[rid]
            if rec.request.abort_after is not None and len(rec.token_ids) >= rec.request.abort_after:
                engine.abort_request(rid)
        outs = engine.step(ctx)
        clock.stepped()
        record(outs, clock.now())
        steps += 1
        if max_steps is not None and steps >= max_steps:
            break
    return [records[r.request_id] for r in requests]


def replay_served(engine, requests: list[Request], params_for) -> list[Record]:
    """`replay` through AsyncLLMEngine, as an LLM replica serves: each request an asyncio client that sends it at its
    arrival and reads its stream, on the wall clock. `engine`: an LLMEngine, driven by a core on a thread of this
    process while outputs cross to the event loop (the host work a replica adds to the step loop when its core
    shares the replica's process), or the AsyncLLMEngine of a core process. Either is left open for the next run."""
    import asyncio

    from engine_ext import AsyncLLMEngine

    records = {r.request_id: Record(r) for r in requests}
    clock = WallClock()
    own = not isinstance(engine, AsyncLLMEngine)
    served = AsyncLLMEngine(engine.config, engine) if own else engine

    async def client(r: Request) -> None:
        rec = records[r.request_id]
        await asyncio.sleep(max(0.0, r.arrival - clock.now()))
        rec.added = clock.now()
        try:
            async for out in served.generate(prompt_token_ids=r.prompt, sampling_params=params_for(r),
                                             adapter_name=r.adapter, request_id=r.request_id):
                rec.took(out, clock.now())
                if not out.finished and r.abort_after is not None and len(rec.token_ids) >= r.abort_after:
                    await served.abort(r.request_id)
        except ValueError as exc:  # refused when added
            rec.error, rec.finish_reason = str(exc), "error"

    async def clients() -> None:
        await asyncio.gather(*(client(r) for r in requests))

    try:
        asyncio.run(clients())
    finally:
        if own:
            served.shutdown(close_engine=False)
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


# Adapter distances from the base (LoRA B scale on the peaked GPU base; see bench.decode.build_model_on_gpu):
# "mixed" is half near, a third mid, some far, so acceptance varies by adapter; "near" is every adapter near.
MIXES = {"mixed": (0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 1.0, 1.0, 1.0, 1.0, 2.0, 100.0), "near": (0.1,)}
MIXED_SCALES = MIXES["mixed"]
MODES = ("base", "plain", "gated", "forced")


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


def parse_mode(mode: str) -> tuple[str, int | None]:
    """A mode name, with an optional draft lead for the drafting modes ("gated@3": gated with SpecConfig.draft_lead
    3, so one run compares leads on identical traffic) -> (name, lead or None)."""
    name, at, lead = mode.partition("@")
    if name not in MODES or (at and (name in ("base", "plain") or not lead.isdigit())):
        raise ValueError(f"mode must be one of {MODES}, a drafting one optionally with @LEAD, got {mode!r}")
    return name, int(lead) if lead else None


def mode_spec(mode: str, k: int, draft_lead: int | None = None):
    """The engine's speculation setting for a mode: None (plain decoding; base-only traffic for "base"), or
    k drafts with the gate deciding ("gated") or drafting every step ("forced"); `draft_lead`: SpecConfig's (None:
    its default), unless the mode names its own ("gated@3")."""
    from engine_ext import SpecConfig

    name, own_lead = parse_mode(mode)
    if name in ("base", "plain"):
        return None
    lead = own_lead if own_lead is not None else draft_lead
    return SpecConfig(num_draft_tokens=k, gate=name == "gated", **({} if lead is None else {"draft_lead": lead}))


def outputs_digest(records: list[Record]) -> str:
    """One hash of every request's output tokens: equal across modes exactly when the outputs are."""
    h = hashlib.sha256()
    for r in records:
        h.update(f"{r.request.request_id}:{r.finish_reason}:{','.join(map(str, r.token_ids))};".encode())
    return h.hexdigest()[:16]


def compare(runs: list[dict]) -> list[dict]:
    """Per load level, the issue's ratios from runs on identical traffic: gated throughput over base-only's,
    gated TTFT/TPOT over plain's, and gated throughput over the better of plain and forced drafting."""
    by_load: dict[str, dict[str, dict]] = {}
    for r in runs:
        if "crash" not in r:
            by_load.setdefault(r["run"], {})[r["mode"]] = r
    out = []

    def ratio(a, b):
        return round(a / b, 3) if a is not None and b else None

    for load, m in by_load.items():
        g, p, f, b = (m.get(k) for k in ("gated", "plain", "forced", "base"))
        row = {"run": load}
        if g and b:
            row["gated_over_base_tput"] = ratio(g["tokens_per_s"], b["tokens_per_s"])
            row["gated_over_base_tpot_p50"] = ratio(g["tpot_ms"]["p50"], b["tpot_ms"]["p50"])
        if p and b:
            row["plain_over_base_tput"] = ratio(p["tokens_per_s"], b["tokens_per_s"])
        if g and p:
            for key in ("ttft_ms", "tpot_ms"):
                for q in ("p50", "p99"):
                    row[f"gated_over_plain_{key[:4]}_{q}"] = ratio(g[key][q], p[key][q])
            row["outputs_equal_plain"] = g["outputs"] == p["outputs"]
        if g and (p or f):
            best = max(x["tokens_per_s"] for x in (p, f) if x)
            row["gated_over_best_tput"] = ratio(g["tokens_per_s"], best)
        out.append(row)
    return out


class GateTrace:
    """`--gate-trace`: every decision the gate's policy takes on cost (plain_cost and speculate), with what priced it:
    the batch (sequences, base-only, prompts, distinct adapters), the chosen draft lengths, the cycle's predicted
    (device, host) seconds and the plain step's, and both rates. Wraps policy.decide while a run lasts; the engine
    is unchanged. `summary()` groups the decisions by batch size; `table(engine)` is the estimator's pass times;
    `steps()` what the steps it read really took (Estimator.observe wrapped likewise): per kind (a prompt-free cycle,
    a plain step of decoding rows) and batch size bucket, the median device seconds (its passes' spans), host seconds,
    launch-to-launch seconds and period (StepResult.period_s), so a step's time beyond max(device, host) shows."""

    def __init__(self, limit: int = 400):
        self.limit, self.rows, self._orig = limit, [], None
        self._observe, self.observed = None, []

    def __enter__(self):
        from engine_ext.speculation import gate as gate_mod
        from engine_ext.speculation import policy, pricing

        orig = self._orig = gate_mod.policy.decide

        def decide(state, batch, est, tune):
            choice, nxt = orig(state, batch, est, tune)
            d = choice.decision
            if d is not None and d.value in ("plain_cost", "speculate") and len(self.rows) < self.limit:
                priced = policy.priced_batch(batch, est)
                lengths = policy.draft_lengths(state, priced, est, tune)
                parts = pricing.cycle_parts(est, priced, lengths) if any(lengths) else None
                t_plain = est.plain(batch.size, priced.distinct)
                ms = lambda v: None if v is None else round(v * 1e3, 3)  # noqa: E731
                self.rows.append({
                    "decision": d.value, "size": batch.size, "base": batch.num_base, "prompts": batch.prompts,
                    "distinct": priced.distinct, "lengths": sorted(set(lengths)),
                    "cycle_ms": None if parts is None else [ms(parts[0]), ms(parts[1])], "plain_ms": ms(t_plain),
                    "cycle_rate": pricing.cycle_rate(est, priced, lengths) if any(lengths) else None,
                    "plain_rate": None if not t_plain else pricing.plain_rate(priced, t_plain)})
            return choice, nxt

        gate_mod.policy.decide = decide
        from engine_ext.speculation.estimator import Estimator

        observe = self._observe = Estimator.observe

        def observed(est, plan, result, seconds, timed=True):
            kinds = {p[0] for p in result.passes}
            kind = "cycle" if plan.speculate else "plain"
            if "prompted" not in kinds and (plan.speculate or plan.decoding == len(plan.seqs)):
                self.observed.append((kind, len(plan.seqs), sum(p[3] for p in result.passes), result.host_s,
                                      seconds, getattr(result, "period_s", 0.0)))
            return observe(est, plan, result, seconds, timed)

        Estimator.observe = observed
        return self

    def __exit__(self, *exc):
        from engine_ext.speculation import gate as gate_mod
        from engine_ext.speculation.estimator import Estimator

        gate_mod.policy.decide = self._orig
        Estimator.observe = self._observe

    def steps(self) -> list[dict]:
        groups: dict[tuple[str, int], list[tuple]] = {}
        for kind, n, dev, host, secs, period in self.observed:
            groups.setdefault((kind, 1 << max(0, (n - 1).bit_length())), []).append((dev, host, secs, period))
        med = lambda v: round(sorted(v)[len(v) // 2] * 1e3, 3) if v else None  # noqa: E731
        return [{"kind": k, "size_bucket": b, "count": len(v), "device_ms": med([x[0] for x in v]),
                 "host_ms": med([x[1] for x in v]), "seconds_ms": med([x[2] for x in v]),
                 "period_ms": med([x[3] for x in v if x[3] > 0])}
                for (k, b), v in sorted(groups.items())]

    def summary(self) -> list[dict]:
        """Per (decision, batch size bucket): count, and the median cycle and plain prices."""
        groups: dict[tuple[str, int], list[dict]] = {}
        for r in self.rows:
            groups.setdefault((r["decision"], 1 << max(0, (r["size"] - 1).bit_length())), []).append(r)
        out = []
        for (d, size), rows in sorted(groups.items()):
            mid = rows[len(rows) // 2]
            out.append({"decision": d, "size_bucket": size, "count": len(rows), "example": mid,
                        "with_prompts": sum(1 for r in rows if r["prompts"])})
        return out

    @staticmethod
    def table(engine) -> dict:
        """The estimator's measured pass times: kind -> {"tokens/adapters": ms}."""
        times = getattr(getattr(engine, "gate", None), "estimator", None)
        if times is None:
            return {}
        out: dict[str, dict[str, float]] = {}
        for (kind, t, a), v in sorted(times.times._t.items()):
            out.setdefault(kind, {})[f"{t}/{a}"] = round(v * 1e3, 3)
        return out


def engine_config(model_dir: str, device: str, num_adapters: int, max_loras: int, rank: int, max_rank: int, spec,
                  compile_cache: str | None = None, debug_checks: bool = False, **fields):
    """The benchmarks' engine: on a GPU the serving fast path (Triton kernels, CUDA graphs up to EngineConfig's
    default size: a full batch's verify pass, what a deployment gets) with 24 GiB of KV; on a CPU the plain-torch
    kernels with 4096 KV blocks. `fields`: more EngineConfig fields."""
    from engine_ext import EngineConfig

    gpu = device.startswith("cuda")
    fast = dict(lora_backend="triton", attn_backend="triton", layer_ops="triton", cuda_graphs=True,
                kv_cache_memory_gb=24) if gpu else dict(num_kv_blocks=4096)
    sizes = dict(max_num_seqs=128, max_num_batched_tokens=8192, max_model_len=2048)
    return EngineConfig(model=model_dir, device=device, dtype="bfloat16" if gpu else "float32",
                        max_loras=max_loras, max_lora_rank=max(max_rank, rank), max_cpu_loras=max(64, num_adapters),
                        speculative=spec, compile_cache_dir=compile_cache, debug_checks=debug_checks,
                        **(fast | sizes | fields))


def _cache_entries(path: str | None) -> int | None:
    return len(os.listdir(path)) if path and os.path.isdir(path) else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--adapters", type=int, default=48)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--mix", choices=sorted(MIXES), default="mixed", help="adapters' distances from the base")
    ap.add_argument("--max-loras", type=int, default=32)
    ap.add_argument("--max-rank", type=int, default=64,
                    help="EngineConfig.max_lora_rank (its default): the slots' width, or what they may grow to from "
                         "--slot-rank")
    ap.add_argument("--slot-rank", type=int, default=None,
                    help="EngineConfig.lora_slot_rank: the slots start this wide and grow when a wider adapter "
                         "arrives (default: the engine's)")
    ap.add_argument("--spec", type=int, default=4, help="draft tokens (0: plain multi-LoRA)")
    ap.add_argument("--no-gate", action="store_true")
    ap.add_argument("--draft-lead", type=int, default=None, help="SpecConfig.draft_lead (default: its default)")
    ap.add_argument("--modes", nargs="+", default=None,
                    help="modes to run on identical traffic, each over every run (default: the one --spec and "
                         "--no-gate name). base: every request on the base model; plain: multi-LoRA decoding; "
                         "gated: --spec drafts, the gate deciding; forced: --spec drafts every step; gated@L, "
                         "forced@L: with draft lead L")
    ap.add_argument("--runs", nargs="+", default=["poisson:10"],
                    help="one run each, on one engine: poisson:RATE, gamma:RATE:CV or burst")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=0,
                    help="requests of the first run's traffic served unmeasured before each mode's runs (the "
                         "gate learns pass times and acceptance as a long-running server's has)")
    ap.add_argument("--popularity", default="zipf:1.0")
    ap.add_argument("--base-share", type=float, default=0.2)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[64, 512])
    ap.add_argument("--output-len", type=int, nargs=2, default=[32, 256])
    ap.add_argument("--compile-cache", default=None, help="Triton cache dir (an empty one: a cold start)")
    ap.add_argument("--debug-checks", action="store_true")
    ap.add_argument("--cpu-threads", type=int, default=None,
                    help="torch intra-op threads on a CPU (1 is fastest for the tiny shape on a shared machine)")
    ap.add_argument("--work-dir", default=os.environ.get("BENCH_DIR") or tempfile.gettempdir())
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (GPUs per engine)")
    ap.add_argument("--quantization", choices=["fp8"], default=None, help="EngineConfig.quantization (base weights)")
    ap.add_argument("--loop", choices=["step", "served", "core"], default="step",
                    help="drive engine.step() directly, or through AsyncLLMEngine with an asyncio client per request: "
                         "its core on a thread of this process (served) or in a process of its own (core, as an LLM "
                         "replica runs it)")
    ap.add_argument("--kernel-settings", type=json.loads, default={},
                    help="JSON object of engine_ext.KernelSettings fields (the Triton kernels' launch settings)")
    ap.add_argument("--gate-trace", action="store_true",
                    help="record the gate's cost decisions and its pass times in each gated run (GateTrace)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    modes = args.modes or ["plain" if not args.spec else "forced" if args.no_gate else "gated"]
    for m in modes:
        try:
            parse_mode(m)
        except ValueError as e:
            ap.error(str(e))
    if args.spec <= 0 and any(parse_mode(m)[0] in ("gated", "forced") for m in modes):
        ap.error("gated and forced modes need --spec > 0")
    if args.gate_trace and args.loop == "core":
        ap.error("--gate-trace wraps the gate in this process: not with --loop core")

    import torch

    from bench.common import SHAPES, machine
    from engine_ext import AsyncLLMEngine, KernelSettings, LLMEngine, SamplingParams, SpecConfig

    gpu = args.device.startswith("cuda")
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    model_dir, adapters = build_workload(args.work_dir, args.shape, args.adapters, args.rank, gpu, MIXES[args.mix])
    spec = SpecConfig(num_draft_tokens=args.spec) if args.spec else None  # sizes the drafting room
    fields = {"kernels": KernelSettings.from_dict(args.kernel_settings)} if args.kernel_settings else {}
    if args.slot_rank is not None:
        fields["lora_slot_rank"] = args.slot_rank
    cfg = engine_config(model_dir, args.device, args.adapters, args.max_loras, args.rank, args.max_rank, spec,
                        args.compile_cache, args.debug_checks, tensor_parallel_size=args.tp,
                        quantization=args.quantization, **fields)
    before = _cache_entries(args.compile_cache)
    if args.loop == "core":  # the engine built in the core's process; this one holds its client
        engine = AsyncLLMEngine(dataclasses.replace(cfg, engine_process=True))
    else:
        engine = LLMEngine(cfg, detokenize=False)  # as an engine core runs it: its client detokenizes
    for n, p in adapters.items():
        engine.add_adapter(n, p)
    gc.collect()
    gc.freeze()  # as an LLM replica does once ready (AppConfig.gc_freeze): no full collection walks the start-up heap
    ready_entries = _cache_entries(args.compile_cache)
    startup = engine.stats()["startup"]
    print("startup", json.dumps(startup), "cache entries", before, "->", ready_entries, file=sys.stderr)
    result = {"machine": machine(), "kernel_settings": args.kernel_settings, "loop": args.loop, "shape": args.shape,
              "quantization": args.quantization,
              "tp": args.tp, "spec": args.spec,
              "draft_lead": args.draft_lead, "modes": modes, "mix": args.mix,
              "adapters": args.adapters, "max_loras": args.max_loras, "rank": args.rank,
              "startup": startup, "cache_entries_before": before,
              "cache_entries_ready": ready_entries, "runs": []}
    vocab = SHAPES[args.shape][5]

    def traffic_for(i: int, run_spec: str, mode: str, num_requests: int) -> list[Request]:
        arrival, *nums = run_spec.split(":")
        rate, cv = (float(nums[0]) if nums else 1.0), (float(nums[1]) if len(nums) > 1 else 1.0)
        requests = generate(TrafficConfig(
            num_requests=num_requests, arrival=arrival, rate=rate, cv=cv, adapters=tuple(adapters),
            popularity=args.popularity, base_share=args.base_share, prompt_len=tuple(args.prompt_len),
            output_len=tuple(args.output_len), vocab=vocab, seed=args.seed + i))
        if mode == "base":  # the same arrivals and lengths, every request on the base model alone
            requests = [dataclasses.replace(r, adapter=None) for r in requests]
        return requests

    def params_for(r: Request):
        return SamplingParams(max_tokens=r.max_tokens, ignore_eos=True)

    crashed = False
    for mode in modes:
        engine.set_speculation(mode_spec(mode, args.spec, args.draft_lead))
        if args.warmup:
            warm = traffic_for(0, args.runs[0], mode, args.warmup)
            replay(engine, [dataclasses.replace(r, request_id="w" + r.request_id) for r in warm], WallClock(),
                   params_for, served=args.loop != "step")
        for i, run_spec in enumerate(args.runs):
            requests = traffic_for(i, run_spec, mode, args.requests)
            run = {"run": run_spec, "mode": mode}
            stats_before = engine.stats()
            start = time.perf_counter()
            trace = GateTrace() if args.gate_trace and parse_mode(mode)[0] == "gated" else None
            try:
                if trace is not None:
                    with trace:
                        records = replay(engine, requests, WallClock(), params_for, served=args.loop != "step")
                    run["gate_trace"] = trace.summary()
                    run["pass_times_ms"] = GateTrace.table(engine)
                    run["step_times"] = trace.steps()
                else:
                    records = replay(engine, requests, WallClock(), params_for, served=args.loop != "step")
                run |= summarize(records, time.perf_counter() - start)
                run["outputs"] = outputs_digest(records)
            except Exception as exc:  # a crash is the result: report it, with how far the run got
                run |= {"crash": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:],
                        "seconds": round(time.perf_counter() - start, 2)}
                print("run", json.dumps({"run": run_spec, "mode": mode, "crash": run["crash"]}), file=sys.stderr)
                result["runs"].append(run)
                crashed = True
                break
            stats = engine.stats()
            run |= spec_delta(stats_before, stats)
            run["cache_entries_after"] = _cache_entries(args.compile_cache)
            run["compiled_while_serving"] = (None if ready_entries is None
                                             else run["cache_entries_after"] - ready_entries)
            ready_entries = run["cache_entries_after"]
            run["preemptions"] = stats["num_preemptions"]
            run["free_kv_blocks_after"] = stats["free_kv_blocks"] == stats["total_kv_blocks"]
            result["runs"].append(run)
            print("run", json.dumps({k: run.get(k) for k in (
                "mode", "run", "finished", "seconds", "tokens_per_s", "ttft_ms", "tpot_ms", "itl_p99_ms",
                "acceptance", "compiled_while_serving", "cycles", "plain_steps")}), file=sys.stderr)
        if crashed:
            break
    if args.loop == "core":
        engine.shutdown()
    result["compare"] = compare(result["runs"])
    for row in result["compare"]:
        print("compare", json.dumps(row), file=sys.stderr)
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
