"""The HF peer of bench/decode.py: greedy decode tokens/s of plain transformers `generate()` (KV cache, bf16 on a
GPU) and of PEFT's mixed-adapter batch (`adapter_names=`), as a user would run them. Prints one JSON object.

Each point runs in a process of its own (decode.py starts this script): in the benchmark's process the engine
measured just before is still alive after `del engine` (reference cycles), and whichever automatic garbage
collection frees it (KV cache, CUDA graphs, pinned adapter buffers) would land inside HF's timed window.

    python bench/hf_peer.py --model DIR                                # base only, batch 32
    python bench/hf_peer.py --model DIR --adapter DIR --distinct 32    # PEFT, 32 distinct adapters in the batch
    python bench/hf_peer.py --smoke                                    # tiny random model on the CPU, both points
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import build_random_adapter, build_random_model, machine  # noqa: E402


def load(model_dir: str, adapter_dir: str | None, distinct: int, device: str):
    """The plain causal LM in bf16 (fp32 on a CPU); with `distinct` > 0, PEFT's causal-LM wrapper holding that
    many adapters (copies of `adapter_dir` under distinct names: PEFT's cost is per name in the batch)."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    if distinct:
        from peft import PeftModelForCausalLM  # the causal-LM class: its generate() takes adapter_names

        model = PeftModelForCausalLM.from_pretrained(model, adapter_dir, adapter_name="a0")
        for i in range(1, distinct):
            model.load_adapter(adapter_dir, adapter_name=f"a{i}")
        model.eval()
    return model


def decode_point(model, distinct: int, batch: int, gen: int, prompt_len: int, repeats: int, warm_full: bool) -> dict:
    """Decode-only tokens/s: (time of 1 + gen new tokens - time of 1 new token) / gen per step, each time the median
    of `repeats` generate() calls, after a warm-up call (of the full length when `warm_full`: every KV length of
    the window then has its kernels loaded and its cache blocks allocated)."""
    device = model.device
    kwargs = {"adapter_names": [f"a{i % distinct}" for i in range(batch)]} if distinct else {}
    vocab = model.config.vocab_size
    ids = torch.randint(10, min(100000, vocab), (batch, prompt_len), generator=torch.Generator().manual_seed(batch))
    ids = ids.to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def run(n: int) -> float:
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0, **kwargs)
        sync()
        return time.perf_counter() - t0

    run(1 + gen if warm_full else 2)
    t1 = statistics.median(run(1) for _ in range(repeats))
    tn = statistics.median(run(1 + gen) for _ in range(repeats))
    step = (tn - t1) / gen
    return {"tokens_per_s": batch / step, "step_ms": step * 1e3, "prefill_ms": t1 * 1e3, "gen": gen,
            "repeats": repeats, "dtype": str(model.dtype).removeprefix("torch.")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="HF model directory")
    ap.add_argument("--adapter", help="PEFT adapter directory (with --distinct > 0)")
    ap.add_argument("--distinct", type=int, default=0, help="distinct adapter names in the batch (0: base only)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--gen", type=int, default=64, help="decode steps in the timed window")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny random model and adapter, base and PEFT, small batch")
    args = ap.parse_args()
    if args.smoke:
        work = tempfile.mkdtemp(prefix="hf-peer-smoke-")
        model_dir = build_random_model(os.path.join(work, "tiny"), "tiny", dtype=torch.float32)
        adapter_dir = build_random_adapter(os.path.join(work, "tiny-r8"), "tiny", 8, seed=0, dtype=torch.float32)
        points = [(None, 0), (adapter_dir, 4)]
        args.batch, args.gen, args.prompt_len, args.repeats = 4, 4, 8, 1
    else:
        if not args.model or (args.distinct and not args.adapter):
            ap.error("--model is required, and --adapter with --distinct")
        model_dir, points = args.model, [(args.adapter, args.distinct)]
    for adapter_dir, distinct in points:
        t0 = time.perf_counter()
        model = load(model_dir, adapter_dir, distinct, args.device)
        load_s = time.perf_counter() - t0
        out = decode_point(model, distinct, args.batch, args.gen, args.prompt_len, args.repeats,
                           warm_full=not distinct)  # a PEFT step is ~1 s at 1B: a short warm-up
        print(json.dumps({"mode": "hf_peft" if distinct else "hf_base", "batch": args.batch, "adapters": distinct,
                          "machine": machine(), **out, "load_s": load_s, "wall_s": time.perf_counter() - t0}),
              flush=True)
        del model


if __name__ == "__main__":
    main()
