"""Where one decode or verify forward's GPU time goes: torch.profiler over eager forwards of the engine's model
(Triton kernels on, no graph), kernels summed by name, beside the same forward's graph replay time. `--tokens`:
query tokens a sequence (1: a decode step; k + 1: a verify pass over k drafts). `--kernel-settings`: the engine's
KernelSettings (JSON, as bench/decode.py takes them); each record names the LoRA path its forward took.

    python bench/profile_step.py --batch 32 --adapters 0 32 --rank 16 --tokens 1 5 [--kernel-settings '{...}']
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import build_random_adapter  # noqa: E402
from bench.decode import CONTEXT, activate, build_engine, build_model_on_gpu, forward_point  # noqa: E402
from engine_ext.batch import SeqWork, build_forward_batch  # noqa: E402
from engine_ext.kernels import KernelSettings  # noqa: E402
from engine_ext.model import LoRABatch  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--adapters", nargs="+", type=int, default=[0, 32])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--tokens", nargs="+", type=int, default=[1], help="query tokens a sequence, each profiled")
    ap.add_argument("--workdir", default=os.environ.get("BENCH_DIR", tempfile.gettempdir()))
    ap.add_argument("--kernel-settings", type=json.loads, default={}, help="KernelSettings fields (JSON object)")
    ap.add_argument("--out", help="also write the records here (JSON)")
    args = ap.parse_args()
    kernels = KernelSettings.from_dict(args.kernel_settings)
    model_dir = build_model_on_gpu(os.path.join(args.workdir, args.shape), args.shape)
    path = build_random_adapter(os.path.join(args.workdir, f"{args.shape}-r{args.rank}"), args.shape, args.rank, 1)
    n = max(args.adapters)
    engine = build_engine(model_dir, {f"a{i}": path for i in range(n)}, max_loras=max(n, 1), max_rank=args.rank,
                          max_graph_tokens=args.batch * max(args.tokens), kernels=kernels)
    runner, slots, bs = engine.runner, engine.adapters.slots, engine.config.block_size
    out = []
    for distinct, tokens in [(d, t) for d in args.adapters for t in args.tokens]:
        names = [f"a{i % distinct}" for i in range(args.batch)] if distinct else [None] * args.batch
        activate(engine, sorted({x for x in names if x}))
        point = forward_point(engine, names, tokens, True, 30)
        nblocks = -(-(CONTEXT + tokens) // bs)
        work = [SeqWork([7] * tokens, CONTEXT, list(range(i * nblocks, (i + 1) * nblocks)), engine.adapters.slot_of(x),
                        num_logits=tokens) for i, x in enumerate(names)]
        batch = build_forward_batch(work, bs, slots.zero_slot, runner.device)
        batch.attn.kernel = runner.attn_kernel
        lora = (LoRABatch.from_slots(runner.lora_op, batch.lora_slots, slots, runner.group_lora_op)
                if batch.has_lora else None)

        def fwd():
            return runner.model(batch.input_ids, batch.attn, runner.kv_caches, batch.logits_indices, lora)

        with torch.inference_mode():
            for _ in range(3):
                fwd()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    fwd()
                torch.cuda.synchronize()
        rows = []
        for ev in prof.key_averages():
            t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
            if t > 0:
                rows.append((t / 5 / 1e3, ev.count // 5, ev.key[:90]))
        rows.sort(reverse=True)
        total = sum(r[0] for r in rows)
        path = runner.model.lora_path(lora, len(batch.input_ids), batch.attn.multi)
        rec = {"shape": args.shape, "rank": args.rank, "batch": args.batch, "distinct": distinct, "tokens": tokens,
               "lora_path": path, "kernel_settings": args.kernel_settings, "graph_gpu_ms": point["gpu_ms"],
               "kernel_sum_ms": total, "kernels_per_forward": sum(r[1] for r in rows),
               "top": [{"ms": round(r[0], 4), "count": r[1], "name": r[2]} for r in rows[:20]]}
        out.append(rec)
        print(json.dumps(rec, indent=1), flush=True)
    print(json.dumps([{k: r[k] for k in ("distinct", "tokens", "lora_path", "graph_gpu_ms", "kernel_sum_ms",
                                         "kernels_per_forward")} for r in out]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
