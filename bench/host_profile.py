"""Where an engine step's host time goes on the machine that serves: `LLMEngine.step()` in a loop at a fixed batch,
each mode on the same engine (base-only, plain multi-LoRA, forced k-draft cycles, the gate), profiled with cProfile.
Per mode: wall ms a step and, of it, the host's wait for the device (`device_wait_s`: the loop ran ahead of it),
timed without the profiler; then, over as many steps profiled, the functions with the most own time (tottime) and
the engine's own functions with the most time under them (cumtime), per step (the profiler's overhead included).
On a GPU the model is the random 1B (or --shape) model with a peaked base (drafts accepted), built like
bench/decode.py's, with its CUDA settings; without one, the tiny random model on the CPU.

    python bench/host_profile.py --batch 8 --modes base plain forced gated --steps 300
    python bench/host_profile.py --stub-forward   # (CPU) the model's forward returns zero logits at once: the
                                                  # profile is the engine's Python alone
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import build_random_adapter, build_random_model, zero_logits_forward  # noqa: E402
from engine_ext import EngineConfig, LLMEngine, SamplingParams, SpecConfig  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build(args) -> LLMEngine:
    cuda = torch.cuda.is_available()
    shape = args.shape if cuda else "tiny"
    work = os.path.join(args.workdir, f"host-profile-{shape}")
    if cuda:
        from bench.decode import build_engine, build_model_on_gpu
        model = build_model_on_gpu(os.path.join(work, "model"), shape, residual_scale=0.1)
    else:
        model = os.path.join(work, "model")
        if not os.path.isfile(os.path.join(model, "config.json")):
            build_random_model(model, shape)
    adapter = build_random_adapter(os.path.join(work, f"near-r{args.rank}"), shape, args.rank, seed=1,
                                   scale=args.near_scale)
    adapters = {f"a{i}": adapter for i in range(args.adapters)}
    if cuda:
        return build_engine(model, adapters, max_loras=max(args.adapters, 8), max_rank=args.rank,
                            max_graph_tokens=512)
    engine = LLMEngine(EngineConfig(model=model, device="cpu", dtype="float32", max_loras=max(args.adapters, 8),
                                    max_lora_rank=args.rank, max_num_seqs=max(args.batch, 8), max_model_len=2048,
                                    speculative=SpecConfig(num_draft_tokens=args.k)))
    for n, p in adapters.items():
        engine.add_adapter(n, p)
    return engine


def stub_forward(engine: LLMEngine) -> None:
    """The model's forward replaced by zero logits for the rows asked for (its 4th argument: the logits indices)."""
    if engine.device.type != "cpu":
        raise SystemExit("--stub-forward is for the CPU (a GPU's forwards replay CUDA graphs)")
    engine.runner.model.forward = zero_logits_forward(engine.runner.spec.vocab_size)


def profile_mode(engine: LLMEngine, mode: str, args) -> dict:
    spec = {"base": None, "plain": None, "forced": SpecConfig(num_draft_tokens=args.k, gate=False),
            "gated": SpecConfig(num_draft_tokens=args.k)}[mode]
    engine.set_speculation(spec)
    names = [None] * args.batch if mode == "base" else [f"a{i % args.adapters}" for i in range(args.batch)]
    g = torch.Generator().manual_seed(args.batch)
    vocab = min(100000, engine.spec.vocab_size)
    for i, name in enumerate(names):  # enough tokens that no request ends inside the window
        engine.add_request(f"{mode}-{i}", prompt_token_ids=torch.randint(10, vocab, (args.prompt_len,),
                                                                        generator=g).tolist(),
                           sampling_params=SamplingParams(max_tokens=(2 * args.steps + args.warmup) * (args.k + 1) + 8,
                                                          ignore_eos=True), adapter_name=name)
    for _ in range(args.warmup):  # the prompts, graph warm-up and the gate's first measurements
        engine.step()
    # Timed without the profiler (its overhead is per Python call), then the same number of steps profiled
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    wait0, tokens0 = engine.counters.device_wait_s, _tokens(engine)
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    sync()
    seconds = time.perf_counter() - start
    waited = engine.counters.device_wait_s - wait0
    tokens = _tokens(engine) - tokens0
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        engine.step()
    prof.disable()
    engine.abort_all()
    while engine.has_unfinished_requests:
        engine.step()
    stats = pstats.Stats(prof)
    rows = []
    ours = lambda path: path.startswith(ROOT) and "site-packages" not in path  # noqa: E731
    for (path, line, fn), (_cc, calls, tottime, cumtime, _callers) in stats.stats.items():
        rows.append({"fn": f"{os.path.relpath(path, ROOT) if path.startswith(ROOT) else os.path.basename(path)}:"
                           f"{line}:{fn}", "calls_per_step": round(calls / args.steps, 2),
                     "own_us_per_step": round(tottime / args.steps * 1e6, 1),
                     "cum_us_per_step": round(cumtime / args.steps * 1e6, 1), "ours": ours(path)})
    own = sorted(rows, key=lambda r: -r["own_us_per_step"])[:args.top]
    engine_cum = sorted((r for r in rows if r["ours"]), key=lambda r: -r["cum_us_per_step"])[:args.top]
    spec_stats = engine.stats().get("speculative") or {}
    return {"mode": mode, "batch": args.batch, "steps": args.steps, "device": str(engine.device),
            "ms_per_step": round(seconds / args.steps * 1e3, 3),
            "device_wait_ms_per_step": round(waited / args.steps * 1e3, 3),
            "host_ms_per_step": round((seconds - waited) / args.steps * 1e3, 3),
            "tokens_per_step": round(tokens / args.steps, 2), "ms_per_token_per_seq":
                round(seconds / max(tokens, 1) * args.batch * 1e3, 3),
            "gate_decisions": spec_stats.get("gate_decisions"), "top_own": own, "top_engine_cum": engine_cum}


def _tokens(engine: LLMEngine) -> int:
    s = engine.stats()
    return s["base"]["tokens"] + sum(a["tokens"] for a in s["adapters"].values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--near-scale", type=float, default=0.02, help="the adapters' B scale (drafts accepted)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--modes", nargs="+", default=["base", "plain", "forced", "gated"],
                    choices=["base", "plain", "forced", "gated"])
    ap.add_argument("--workdir", default=os.environ.get("BENCH_DIR", tempfile.gettempdir()))
    ap.add_argument("--stub-forward", action="store_true", help="(CPU) zero logits instead of the model's forward")
    ap.add_argument("--out", help="also write the records here (JSON lines)")
    args = ap.parse_args()
    engine = build(args)
    if args.stub_forward:
        stub_forward(engine)
    # The start-up heap out of every later collection, as a serving process does once ready (engine_ext/core/process.py,
    # AppConfig.gc_freeze): without it a full collection walks it now and then, about 2 ms a step on average in a k = 4
    # cycle at batch 128 on the 2-core VM, landing on whichever function runs then
    gc.collect()
    gc.freeze()
    for mode in args.modes:
        rec = profile_mode(engine, mode, args)
        line = json.dumps(rec)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
    engine.close()


if __name__ == "__main__":
    main()
