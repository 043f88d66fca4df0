"""GPU smoke for the engine core: decode tokens/s at the Llama-3.2-1B shape, batch 32, with 0 and with
32 distinct rank-16 adapters (random bf16 weights). Prints one JSON object.

    python bench/smoke.py --device cuda --workdir /tmp/bench     # on the H200
    python bench/smoke.py --device cpu --shape tiny              # anywhere
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import build_random_adapter, build_random_model, machine, measure_decode  # noqa: E402
from engine_ext import EngineConfig, LLMEngine, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--adapters", type=int, nargs="+", default=[0, 32])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--workdir", default="/tmp/loraserve-bench")
    args = ap.parse_args()
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    tdtype = getattr(torch, dtype)
    t0 = time.perf_counter()
    model = build_random_model(os.path.join(args.workdir, args.shape), args.shape, dtype=tdtype)
    n_ad = max(args.adapters)
    adapters = [build_random_adapter(os.path.join(args.workdir, f"{args.shape}-r{args.rank}-{i}"), args.shape,
                                      args.rank, seed=i, dtype=tdtype) for i in range(n_ad)]
    build_s = time.perf_counter() - t0
    engine = LLMEngine(EngineConfig(model=model, device=args.device, dtype=dtype, max_loras=max(1, n_ad),
                                    max_lora_rank=args.rank, max_cpu_loras=max(1, n_ad), max_num_seqs=args.batch,
                                    kv_cache_memory_gb=8 if args.device == "cuda" else 1))
    for i, path in enumerate(adapters):
        engine.add_adapter(f"a{i}", path)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, engine.spec.vocab_size, (args.prompt_len,), generator=g).tolist()
               for _ in range(args.batch)]
    results = []
    for n in args.adapters:
        names = [f"a{i % n}" if n else None for i in range(args.batch)]
        measure_decode(engine, prompts, names, 8, SamplingParams)  # warm-up: loads adapters into slots
        r = measure_decode(engine, prompts, names, args.max_tokens, SamplingParams)
        results.append({"distinct_adapters": n, "rank": args.rank if n else 0, **r})
    print(json.dumps({"bench": "smoke", "machine": machine(), "shape": args.shape, "batch": args.batch,
                      "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "build_seconds": build_s,
                      "results": results}, indent=1))


if __name__ == "__main__":
    main()
