"""The batched LoRA op variants on the GPU at the Llama-3.2-1B shape: every group of all 16 layers
(q/k/v, o, gate/up, down) captured in one CUDA graph and replayed, per variant, against the bytes the
distinct adapters' weights take (the floor at 4.3 TB/s). Prints JSON.

    python bench/lora_kernels.py
Variants: "per-module" (seven shrink+expand pairs per layer), "group" (one shrink+expand pair per
group). A third, one launch per group (shrink and expand in one kernel, each column tile re-reading
its adapter's A), was measured slower at every point and removed (`git show 211e305:bench/RESULTS.md`).
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import graph_ms  # noqa: E402
from engine_ext.kernels import triton_lora  # noqa: E402

HBM = 4.3e12
HIDDEN, INTER, Q, KV, LAYERS = 2048, 8192, 2048, 512, 16
GROUPS = {"qkv": (HIDDEN, (Q, KV, KV)), "o": (Q, (HIDDEN,)), "gate_up": (HIDDEN, (INTER, INTER)),
          "down": (INTER, (HIDDEN,))}


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


def run_variant(variant, st, xs, ys, idx):
    for layer in range(LAYERS):
        for name, (a, b, scale, segs) in st.items():
            x, y = xs[name], ys[name]
            if variant == "per-module":
                ends = list(segs[1:]) + [y.shape[1]]
                r = b.shape[2]
                for s, (lo, hi) in enumerate(zip(segs, ends)):
                    triton_lora.add_lora_triton(y[:, lo:hi], x, a[layer][:, :, s * r:(s + 1) * r],
                                                b[layer][:, :, lo:hi], scale[layer][:, s], idx)
            else:
                triton_lora.add_lora_group_triton(y, x, a[layer], b[layer], scale[layer], idx, segs)


def main():
    g = torch.Generator("cuda").manual_seed(0)
    results = []
    for rank in (16, 64):
        st = stacks(rank, 33, g)
        per_adapter = 2 * rank * LAYERS * sum(fin + sum(outs) for fin, outs in GROUPS.values())
        for tokens, per_seq in ((32, 1), (160, 5)):
            idx = torch.arange(32, device="cuda").repeat_interleave(per_seq)
            xs = {n: torch.randn(tokens, fin, device="cuda", generator=g).bfloat16() for n, (fin, _) in GROUPS.items()}
            ys = {n: torch.zeros(tokens, sum(outs), device="cuda").bfloat16() for n, (_, outs) in GROUPS.items()}
            row = {"rank": rank, "tokens": tokens, "distinct": 32, "bytes_floor_ms": 32 * per_adapter / HBM * 1e3}
            for variant in ("per-module", "group"):
                row[variant + "_ms"] = graph_ms(lambda: run_variant(variant, st, xs, ys, idx), 50)
            results.append(row)
            print(json.dumps(row), flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
