"""GPU forward cost at larger batches against token order: base-only, plain multi-LoRA and verify passes (k + 1
tokens per sequence) at batches 32, 64 and 128 over 32 rank-R adapters, with the batch's rows in arrival order or
grouped by adapter (the scheduler groups them: the LoRA kernels read an adapter's tiles once per run of rows
sharing it), and one 640-token verify pass run eagerly (past the largest CUDA graph) against its graph replay.
Adapter mixes: "zipf" (20% base-only, popularity 1/i) and "inter" (the 32 adapters interleaved). Prints JSON lines
and writes a JSON list. `--kernel-settings` (JSON of engine_ext.KernelSettings fields) compares launch settings.

    python bench/forward_order.py --rank 16 --out order.json
    python bench/forward_order.py --batches 128 --kernel-settings '{"attn_rows": 32}'
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import build_random_adapter  # noqa: E402
from bench.decode import CONTEXT, activate, build_engine, build_model_on_gpu, forward_point  # noqa: E402
from engine_ext import KernelSettings  # noqa: E402
from engine_ext.batch import SeqWork  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--workdir", default=os.environ.get("BENCH_DIR", tempfile.gettempdir()))
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--kernel-settings", default="{}", help="JSON of engine_ext.KernelSettings fields")
    ap.add_argument("--no-eager", action="store_true", help="skip the eager verify pass")
    ap.add_argument("--out")
    args = ap.parse_args()
    kernels = KernelSettings.from_dict(json.loads(args.kernel_settings))
    model_dir = build_model_on_gpu(os.path.join(args.workdir, "llama-3.2-1b-peaked"), "llama-3.2-1b",
                                   residual_scale=0.001)
    adapter = build_random_adapter(os.path.join(args.workdir, f"llama-3.2-1b-r{args.rank}"), "llama-3.2-1b",
                                   args.rank, seed=args.rank)
    names32 = [f"a{i}" for i in range(32)]
    engine = build_engine(model_dir, {n: adapter for n in names32}, max_loras=32, max_rank=args.rank,
                          max_graph_tokens=1024, kernels=kernels)
    activate(engine, names32)
    rng = random.Random(0)
    weights = [1 / (i + 1) for i in range(32)]
    out = []

    def point(tag, names, tokens_per_seq, use_lora=True):
        rec = dict(tag=tag, batch=len(names), k=tokens_per_seq - 1, distinct=len({n for n in names if n}),
                   kernels=args.kernel_settings,
                   **forward_point(engine, names, tokens_per_seq, use_lora, 30))
        out.append(rec)
        print(json.dumps(rec), flush=True)

    for batch in args.batches:
        zipf = [None if rng.random() < 0.2 else rng.choices(names32, weights)[0] for _ in range(batch)]
        inter = [names32[i % 32] for i in range(batch)]
        point("base", [None] * batch, 1, False)
        for mix, names in (("zipf", zipf), ("inter", inter)):
            grouped = sorted(names, key=lambda n: n or "")
            for tokens_per_seq in (1, 2, 3, 5):
                point(f"{mix}-unsorted", names, tokens_per_seq)
                point(f"{mix}-grouped", grouped, tokens_per_seq)
        for tokens_per_seq in (2, 3, 5):  # the base model's cost of each verify shape: what LoRA adds is the rest
            point(f"base-tokens-x{tokens_per_seq}", [None] * batch, tokens_per_seq, False)
    if not args.no_eager:  # the eager path's cost for a 640-token verify pass (batch 128, k = 4, grouped)
        out.append(dict(tag="eager-verify-k4-b128-grouped", ms=eager_verify_ms(engine, names32)))
        print(json.dumps(out[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


def eager_verify_ms(engine, names32: list[str]) -> float:
    names = sorted(names32[i % 32] for i in range(128))
    runner, slots, bs = engine.runner, engine.adapters.slots, engine.config.block_size
    nblocks = -(-(CONTEXT + 5) // bs)
    work = [SeqWork([7] * 5, CONTEXT, list(range(i * nblocks, (i + 1) * nblocks)), engine.adapters.slot_of(n),
                    num_logits=5) for i, n in enumerate(names)]
    for _ in range(3):
        runner._run_eager(work, slots, True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        runner._run_eager(work, slots, True)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / 20 * 1e3


if __name__ == "__main__":
    main()
