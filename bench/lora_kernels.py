"""The batched LoRA op variants on the GPU at the Llama-3.2-1B shape: every group of all 16 layers
(q/k/v, o, gate/up, down) captured in one CUDA graph and replayed, per variant, against the bytes the
distinct adapters' weights take (the floor at 4.3 TB/s). Prints JSON.

    python bench/lora_kernels.py [--shape llama-3.1-8b] [--delta-programs 264 528]
Variants: "per-module" (seven shrink+expand pairs per layer), "group" (one shrink+expand pair per
group), and the beside path's float32 deltas (group_delta, run_tokens as a verify pass's): "split-delta" (the
split shrink and expand) and "delta-P" (one launch, KernelSettings.delta_programs P). An earlier one-launch
kernel, each column tile re-reading its adapter's A, was measured slower at decode and removed (`git show
211e305:bench/RESULTS.md`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import graph_ms  # noqa: E402
from engine_ext.kernels import KernelSettings, triton_lora  # noqa: E402

HBM = 4.3e12
SHAPES = {"llama-3.2-1b": (2048, 8192, 2048, 512, 16), "llama-3.1-8b": (4096, 14336, 4096, 1024, 32)}
GROUPS: dict = {}
LAYERS = 16


def set_shape(name):
    global LAYERS
    hidden, inter, q, kv, LAYERS = SHAPES[name]
    GROUPS.clear()
    GROUPS.update({"qkv": (hidden, (q, kv, kv)), "o": (q, (hidden,)), "gate_up": (hidden, (inter, inter)),
                   "down": (inter, (hidden,))})


def stacks(rank, slots, g):
    out = {}
    for name, (fin, outs) in GROUPS.items():
        a = (torch.randn(LAYERS, slots, fin, len(outs) * rank, device="cuda", generator=g) * fin**-0.5).bfloat16()
        b = (torch.randn(LAYERS, slots, rank, sum(outs), device="cuda", generator=g) * 0.01).bfloat16()
        a[:, -1] = 0
        b[:, -1] = 0
        scale = torch.ones(LAYERS, slots, len(outs), device="cuda")
        out[name] = (a, b, scale, tuple(int(sum(outs[:i])) for i in range(len(outs))))
    return out


def run_variant(variant, st, xs, ys, idx, settings=None, run_tokens=1):
    for layer in range(LAYERS):
        for name, (a, b, scale, segs) in st.items():
            x, y = xs[name], ys[name]
            if settings is not None:  # the beside path's float32 delta
                triton_lora.group_delta(x, a[layer], b[layer], scale[layer], idx, segs, run_tokens=run_tokens,
                                        settings=settings)
            elif variant == "per-module":
                ends = list(segs[1:]) + [y.shape[1]]
                r = b.shape[2]
                for s, (lo, hi) in enumerate(zip(segs, ends)):
                    triton_lora.add_lora_triton(y[:, lo:hi], x, a[layer][:, :, s * r:(s + 1) * r],
                                                b[layer][:, :, lo:hi], scale[layer][:, s], idx)
            else:
                triton_lora.add_lora_group_triton(y, x, a[layer], b[layer], scale[layer], idx, segs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    ap.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--delta-programs", type=int, nargs="*", default=[264, 528, 1056])
    ap.add_argument("--settings", nargs="*", default=[], help="more delta variants: KernelSettings JSON objects")
    args = ap.parse_args()
    set_shape(args.shape)
    g = torch.Generator("cuda").manual_seed(0)
    results = []
    deltas = {"split-delta": KernelSettings()}
    deltas.update({f"delta-{p}": KernelSettings(delta_programs=p) for p in args.delta_programs})
    deltas.update({f"delta-{v}": KernelSettings.from_dict(json.loads(v)) for v in args.settings})
    for rank in args.ranks:
        st = stacks(rank, 33, g)
        per_adapter = 2 * rank * LAYERS * sum(fin + sum(outs) for fin, outs in GROUPS.values())
        for tokens, per_seq in ((32, 1), (40, 5), (160, 5)):
            idx = (torch.arange(tokens // per_seq, device="cuda") % 32).repeat_interleave(per_seq)
            xs = {n: torch.randn(tokens, fin, device="cuda", generator=g).bfloat16() for n, (fin, _) in GROUPS.items()}
            ys = {n: torch.zeros(tokens, sum(outs), device="cuda").bfloat16() for n, (_, outs) in GROUPS.items()}
            distinct = min(32, tokens // per_seq)
            row = {"shape": args.shape, "rank": rank, "tokens": tokens, "per_sequence": per_seq, "distinct": distinct,
                   "bytes_floor_ms": distinct * per_adapter / HBM * 1e3}
            for variant in ("per-module", "group"):
                row[variant + "_ms"] = graph_ms(lambda: run_variant(variant, st, xs, ys, idx), 50)
            for variant, settings in deltas.items():
                row[variant + "_ms"] = graph_ms(
                    lambda: run_variant(variant, st, xs, ys, idx, settings, 4 if per_seq > 1 else 1), 50)
            results.append(row)
            print(json.dumps(row), flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
