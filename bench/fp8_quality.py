"""What FP8 base weights do to SmolLM2-135M-Instruct and its four adapters: greedy agreement with the full-precision
base and the base's draft acceptance per adapter, on the CPU, through the engine (float32 products).

    python bench/fp8_quality.py                                 # 120 prompts x 64 tokens, base + 4 adapters (~25 min)
    python bench/fp8_quality.py --prompts 8 --max-tokens 16     # a quick look
    python bench/fp8_quality.py --table result.json             # RESULTS.md's tables from its JSON

Variants of the base model (LoRA A/B, embeddings, norms, LM head and KV cache in float32 in all of them):
  full   the float32 checkpoint, the reference
  bf16   the decoder projections rounded to bfloat16 (what a GPU serves), for scale: bf16's own disagreement
  fp8    EngineConfig(quantization="fp8"): e4m3 with per-output-channel scales, quantized at load
Each variant serves every request in one batch with forced speculation (k drafts every cycle, no gate), whose output
is plain greedy decoding's (lossless: tests/engine_ext/test_speculative_greedy.py, FP8 included), so one run gives
both the tokens and the acceptance.

Prompts: per adapter, its own held-out questions (demo/smollm2/data.py, seed 1234; docstring has 80) topped up in
turn from the other behaviours' held-out questions; the base gets the four kinds in turn. Chat template, greedy,
at most --max-tokens tokens (EOS ends a reply early).

Per model (base, each adapter) and variant against full:
  exact          requests whose tokens equal full's, all of them (EOS included)
  prefix         tokens before the first divergence over full's tokens, summed over requests (token-level agreement up
                 to the first divergence; a request equal to full's counts all its tokens)
  first_diverge  median position of the first differing token among the requests that differ
Per adapter and variant: acceptance (accepted over judged drafts), accepted/drafted, tokens per cycle.
Memory: the linear weights' bytes of each format, measured on SmolLM2, and computed for the 1B and 8B shapes of
bench/common.py (a calculation: bf16 against FP8 + float32 scales, the KV tokens that 85% of the bytes freed holds).
Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import SHAPES, commit, machine  # noqa: E402
from demo import ensure_smollm2  # noqa: E402
from demo.smollm2.data import conversations  # noqa: E402
from demo.smollm2.samples import chat_ids  # noqa: E402
from engine_ext import EngineConfig, LLMEngine, SamplingParams, SpecConfig  # noqa: E402
from engine_ext.quantization import LINEAR_WEIGHT  # noqa: E402

BASE = "base"


def prompt_sets(tok, adapters: list[str], n: int) -> dict[str, list[list[int]]]:
    """{model: n prompt token lists}: each adapter's own held-out questions first, then the others' in turn."""
    held = {a: [user for user, _ in conversations(a, "heldout", seed=1234)] for a in adapters}
    def mix(order: list[str], used: dict[str, int], want: int) -> list[str]:
        out = []
        while len(out) < want:
            if all(used[a] == len(held[a]) for a in order):
                raise SystemExit(f"--prompts {n}: not enough held-out questions")
            for a in order:
                if len(out) < want and used[a] < len(held[a]):
                    out.append(held[a][used[a]])
                    used[a] += 1
        return out
    sets = {BASE: mix(adapters, {a: 0 for a in adapters}, n)}
    for a in adapters:
        own = held[a][:n]
        sets[a] = own + mix([b for b in adapters if b != a], {b: 0 for b in adapters}, n - len(own))
    return {m: [chat_ids(tok, p) for p in ps] for m, ps in sets.items()}


def bf16_copy(model_dir: str, out_dir: str) -> str:
    """The model directory with its decoder projections rounded to bfloat16 (stored as float32)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out_dir, ignore=shutil.ignore_patterns("*.safetensors*"))
    for path in Path(model_dir).glob("*.safetensors"):
        tensors = {n: t.to(torch.bfloat16).float() if LINEAR_WEIGHT.match(n) else t for n, t in load_file(path).items()}
        save_file(tensors, str(Path(out_dir) / path.name), metadata={"format": "pt"})
    return out_dir


def run(model_dir: str, adapters: dict[str, str], prompts: dict[str, list[list[int]]], quantization: str | None,
        k: int, max_tokens: int) -> tuple[dict[str, list[list[int]]], dict, float, int]:
    """Every request in one batch, forced speculation. -> (tokens by model, stats, seconds, linear weight bytes)."""
    engine = LLMEngine(EngineConfig(model=model_dir, device="cpu", dtype="float32", quantization=quantization,
                                    max_loras=len(adapters), max_lora_rank=16,
                                    speculative=SpecConfig(num_draft_tokens=k, gate=False, min_acceptance=0.0)))
    for name, path in adapters.items():
        engine.add_adapter(name, path)
    order = [(m, i) for m in prompts for i in range(len(prompts[m]))]
    t0 = time.perf_counter()
    outs = engine.generate(prompt_token_ids=[prompts[m][i] for m, i in order],
                           sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
                           adapter_names=[None if m == BASE else m for m, _ in order])
    seconds = time.perf_counter() - t0
    tokens: dict[str, list[list[int]]] = {m: [] for m in prompts}
    for (m, _), out in zip(order, outs):
        tokens[m].append(list(out.token_ids))
    return tokens, engine.stats(), seconds, linear_bytes(engine)


def linear_bytes(engine: LLMEngine) -> int:
    """Bytes of the decoder layers' product weights (FP8: the e4m3 bytes and the float32 scales)."""
    total = 0
    for layer in engine.runner.model.layers:
        for w in (layer.qkv, layer.o, layer.gate_up, layer.down):
            parts = [w] if isinstance(w, torch.Tensor) else [w.weight, w.scale]
            total += sum(p.numel() * p.element_size() for p in parts)
    return total


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    prefixes, diverge = [], []
    for a, b in zip(ref, got):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if a != b:
            diverge.append(n)
        prefixes.append(min(n, len(a)))
    return {"exact": round(sum(a == b for a, b in zip(ref, got)) / len(ref), 3),
            "prefix": round(sum(prefixes) / max(1, sum(len(a) for a in ref)), 3),
            "first_diverge": statistics.median(diverge) if diverge else None,
            "requests": len(ref), "ref_tokens": sum(len(a) for a in ref)}


def acceptance(stats: dict, name: str) -> dict:
    a = stats["adapters"][name]
    per_verify = a["mean_accepted_length"]
    return {"acceptance": a["acceptance_rate"], "accepted_per_drafted": a["draft_efficiency"],
            "tokens_per_cycle": None if per_verify is None else per_verify + 1, "drafted": a["drafted_tokens"]}


def shape_memory(shape: str) -> dict:
    """A calculation from bench/common.py's SHAPES: bf16 linear weights against FP8 + float32 per-channel scales, and
    the KV tokens (bf16 K and V, every layer) and 16-token blocks that 85% of the bytes freed holds (the engine gives
    85% of the GPU's free memory to the KV cache)."""
    hidden, inter, layers, heads, kv_heads, _ = SHAPES[shape]
    head_dim = hidden // heads
    rows = heads * head_dim + 2 * kv_heads * head_dim + hidden + 2 * inter + hidden  # qkv, o, gate/up, down
    params = layers * (hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * inter)
    bf16, fp8 = 2 * params, params + 4 * layers * rows
    kv_token = 2 * layers * kv_heads * head_dim * 2
    tokens = int(0.85 * (bf16 - fp8) // kv_token)
    return {"linear_params": params, "bf16_bytes": bf16, "fp8_bytes": fp8, "freed_bytes": bf16 - fp8,
            "kv_bytes_per_token": kv_token, "more_kv_tokens": tokens, "more_kv_blocks": tokens // 16,
            "more_seqs_at_2048": tokens // 2048}


def linear_ms(threads: int) -> dict:
    """One SmolLM2 gate/up product ([3072, 576]) at 32 tokens: dense float32 against FP8 widened per call; an FP8 copy
    cached as float32 would cost the dense product's time (it is that product) at 1.25x dense memory."""
    from engine_ext.quantization import fp8_linear, quantize_fp8

    torch.set_num_threads(threads)
    w, x = torch.randn(3072, 576), torch.randn(32, 576)
    w8, scale = quantize_fp8(w)
    out = {}
    for name, fn in (("dense", lambda: torch.nn.functional.linear(x, w)), ("fp8", lambda: fp8_linear(x, w8, scale))):
        fn()
        t0 = time.perf_counter()
        for _ in range(50):
            fn()
        out[name] = round((time.perf_counter() - t0) / 50 * 1e3, 3)
    return out


def markdown(result: dict) -> str:
    variants = [v for v in result["variants"] if v != "full"]
    head = ["model"] + [f"{v}: exact / prefix / first diverge" for v in variants]
    head += [f"acceptance {v}" for v in result["variants"]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in result["agreement"][variants[0]]:
        row = [m]
        for v in variants:
            a = result["agreement"][v][m]
            row.append(f"{a['exact']:.2f} / {a['prefix']:.2f} / {a['first_diverge']}")
        for v in result["variants"]:
            acc = result["acceptance"][v].get(m)
            row.append("-" if acc is None else f"{acc['acceptance']:.2f} ({acc['tokens_per_cycle']:.2f})")
        lines.append("| " + " | ".join(row) + " |")
    mem = result["memory"]
    lines += ["", "| shape | linear weights bf16 | FP8 + scales | freed | more KV tokens (blocks of 16) | "
              "more 2,048-token sequences |", "|---|---|---|---|---|---|"]
    for shape, s in mem["shapes"].items():
        lines.append(f"| {shape} | {s['bf16_bytes'] / 1e9:.2f} GB | {s['fp8_bytes'] / 1e9:.2f} GB | "
                     f"{s['freed_bytes'] / 1e9:.2f} GB | {s['more_kv_tokens']:,} ({s['more_kv_blocks']:,}) | "
                     f"{s['more_seqs_at_2048']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=120, help="prompts per model (base and each adapter)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4, help="drafts per cycle")
    ap.add_argument("--variants", nargs="+", default=["full", "bf16", "fp8"], choices=["full", "bf16", "fp8"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--table", type=Path, help="print the markdown tables of this JSON result and exit")
    args = ap.parse_args(argv)
    if args.table:
        print(markdown(json.loads(args.table.read_text())))
        return 0
    if args.variants[0] != "full":
        ap.error("--variants: 'full' first (the reference)")
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    paths = ensure_smollm2()
    tok = AutoTokenizer.from_pretrained(paths["model"])
    prompts = prompt_sets(tok, list(paths["adapters"]), args.prompts)
    result = {"bench": "fp8_quality", "commit": commit(), "machine": machine(), "threads": args.threads,
              "prompts_per_model": args.prompts, "max_tokens": args.max_tokens, "k": args.k,
              "variants": args.variants, "agreement": {}, "acceptance": {}, "seconds": {},
              "memory": {"smollm2_linear_bytes": {}, "shapes": {s: shape_memory(s)
                                                             for s in ("llama-3.2-1b", "llama-3.1-8b")},
                         "linear_ms_gate_up_32_tokens": linear_ms(args.threads)}}
    tokens = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in args.variants:
            model_dir = bf16_copy(paths["model"], os.path.join(tmp, "bf16")) if variant == "bf16" else paths["model"]
            quantization = "fp8" if variant == "fp8" else None
            tokens[variant], stats, secs, nbytes = run(model_dir, paths["adapters"], prompts, quantization, args.k,
                                                       args.max_tokens)
            result["seconds"][variant] = round(secs, 1)
            result["memory"]["smollm2_linear_bytes"][variant] = nbytes
            result["acceptance"][variant] = {a: acceptance(stats, a) for a in paths["adapters"]}
            if variant != "full":
                result["agreement"][variant] = {m: agreement(tokens["full"][m], tokens[variant][m]) for m in prompts}
            print(f"[fp8_quality] {variant} {secs:.0f}s", file=sys.stderr, flush=True)
    # what a divergence looks like: each model's first two replies, full against the others
    result["examples"] = {m: [{v: tok.decode(tokens[v][m][i], skip_special_tokens=True)[:160] for v in args.variants}
                              for i in range(min(2, args.prompts))] for m in prompts}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
