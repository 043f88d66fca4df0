"""Speculative LoRA-off drafting vs plain multi-LoRA decoding, in one run on one machine.

Modes: plain multi-LoRA, speculative with the gate off at k = 1..K (always drafts), speculative with
the gate on (k = K). Reports decode tokens/s, per-step latency and per-adapter acceptance. The
adapters' `--scale` sets how far they are from the base, and so the acceptance rate. Prints JSON.

    python bench/speculative.py --shape tiny --device cpu                      # random tiny model, CPU
    python bench/speculative.py --demo --device cpu                            # the embedded demo adapters
    python bench/speculative.py --shape llama-3.2-1b --device cuda --rank 64   # on the H200
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import build_random_adapter, build_random_model, machine, measure_decode  # noqa: E402
from engine_ext import EngineConfig, LLMEngine, SamplingParams, SpecConfig  # noqa: E402

DEMO_PROMPTS = ["def ", "class ", "import os\n", "    return ", "The ", "# ", "if __name__", "for i in "]


def setup(args, tdtype):
    if args.demo:
        from demo import ensure_demo

        paths = ensure_demo()
        return paths["model"], paths["adapters"]
    model = build_random_model(os.path.join(args.workdir, args.shape), args.shape, dtype=tdtype)
    adapters = {f"a{i}": build_random_adapter(os.path.join(args.workdir, f"{args.shape}-r{args.rank}-s{args.scale}-{i}"),
                                              args.shape, args.rank, seed=100 + i, scale=args.scale, dtype=tdtype)
                for i in range(args.adapters)}
    return model, adapters


def fast_options(args) -> dict:
    """--fast: the GPU path (Triton LoRA and paged-attention kernels, CUDA graphs)."""
    if not args.fast:
        return {}
    return {"lora_backend": "triton", "attn_backend": "triton", "layer_ops": "triton", "cuda_graphs": True,
            "max_model_len": 512}


def run_mode(model, adapters, spec, args, dtype, prompts, names):
    engine = LLMEngine(EngineConfig(model=model, device=args.device, dtype=dtype, max_loras=max(1, len(adapters)),
                                    max_cpu_loras=max(1, len(adapters)), max_lora_rank=max(args.rank, 64),
                                    max_num_seqs=args.batch, speculative=spec,
                                    kv_cache_memory_gb=8 if args.device == "cuda" else 0.5, **fast_options(args)))
    for name, path in adapters.items():
        engine.add_adapter(name, path)
    measure_decode(engine, prompts, names, 8, SamplingParams)  # warm-up: adapter loads, gate measurements
    r = measure_decode(engine, prompts, names, args.max_tokens, SamplingParams)
    stats = engine.stats()
    r["acceptance"] = {n: s.get("acceptance_rate") for n, s in stats["adapters"].items()}
    if "speculative" in stats:
        r["gate"] = stats["speculative"]["gate_decisions"]
        r["draft_passes"] = stats["speculative"]["draft_passes"]
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--demo", action="store_true", help="use the embedded demo model and adapters")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--scale", type=float, default=0.05, help="adapter distance from the base (acceptance)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--workdir", default="/tmp/loraserve-bench")
    ap.add_argument("--fast", action="store_true", help="Triton kernels + CUDA graphs (GPU only)")
    args = ap.parse_args()
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    model, adapters = setup(args, getattr(torch, dtype))
    names_all = sorted(adapters)
    names = [names_all[i % len(names_all)] for i in range(args.batch)]
    if args.demo:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model)
        prompts = [tok(DEMO_PROMPTS[i % len(DEMO_PROMPTS)])["input_ids"] for i in range(args.batch)]
    else:
        g = torch.Generator().manual_seed(0)
        vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
        prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
    modes = {"plain": None}
    modes |= {f"spec-k{k}": SpecConfig(num_draft_tokens=k, gate=False) for k in range(1, args.k + 1)}
    modes[f"spec-k{args.k}-gate"] = SpecConfig(num_draft_tokens=args.k, gate=True)
    run_mode(model, adapters, None, args, dtype, prompts, names)  # process warm-up, not reported
    results = {m: run_mode(model, adapters, spec, args, dtype, prompts, names) for m, spec in modes.items()}
    plain = results["plain"]["tokens_per_s"]
    for r in results.values():
        r["speedup_vs_plain"] = r["tokens_per_s"] / plain
    print(json.dumps({"bench": "speculative", "machine": machine(), "model": "demo" if args.demo else args.shape,
                      "batch": args.batch, "distinct_adapters": len(adapters), "rank": None if args.demo else args.rank,
                      "scale": None if args.demo else args.scale, "max_tokens": args.max_tokens, "fast": args.fast,
                      "results": results},
                     indent=1))


if __name__ == "__main__":
    main()
