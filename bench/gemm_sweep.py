"""The decode step's matrix products at the Llama-3.2-1B shape: F.linear (cuBLAS) against the skinny Triton
kernel (kernels/triton_gemm.py) over its launch settings. Each product is timed as a CUDA graph of 16 calls
on 16 distinct weight copies (one per layer, so the 50 MB L2 cannot hold them), beside its bytes floor at
4.3 TB/s. Prints JSON rows and, per product, the best setting and its speed-up over F.linear.

    python bench/gemm_sweep.py [--rows 32]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import graph_ms  # noqa: E402
from engine_ext.kernels import triton_gemm as tg  # noqa: E402

HBM = 4.3e12
LAYERS = 16
PRODUCTS = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
            "lm_head": (128256, 2048)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[32])
    ap.add_argument("--products", nargs="+", default=list(PRODUCTS))
    args = ap.parse_args()
    g = torch.Generator("cuda").manual_seed(0)
    saved = {k: getattr(tg, k) for k in ("BLOCK_N", "BLOCK_K", "NUM_STAGES", "NUM_WARPS", "TARGET_BLOCKS")}
    best = {}
    for name in args.products:
        n, k = PRODUCTS[name]
        copies = 1 if name == "lm_head" else LAYERS  # one LM head (525 MB) per step
        ws = [(torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16() for _ in range(copies)]
        floor = copies * n * k * 2 / HBM * 1e3
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
            lib = graph_ms(lambda: [F.linear(x, w) for w in ws], 20)
            ref = F.linear(x, ws[0]).float()
            key = f"{name}/m{m}"
            best[key] = {"product": name, "m": m, "flinear_ms": lib, "floor_ms": floor, "ms": None}
            print(json.dumps({"product": name, "m": m, "kernel": "F.linear", "ms": lib, "floor_ms": floor}), flush=True)
            for block_n, block_k, stages, target in itertools.product((32, 64, 128), (128, 256), (3, 4), (264,)):
                tg.BLOCK_N, tg.BLOCK_K, tg.NUM_STAGES, tg.TARGET_BLOCKS = block_n, block_k, stages, target
                row = {"product": name, "m": m, "kernel": "skinny", "block_n": block_n, "block_k": block_k,
                       "stages": stages, "target": target, "plan": tg.plan(m, n, k)}
                try:
                    err = ((tg.skinny_matmul(x, ws[0]).float() - ref).norm() / ref.norm()).item()
                    row |= {"ms": graph_ms(lambda: [tg.skinny_matmul(x, w) for w in ws], 20), "rel_err": err}
                except Exception as e:  # e.g. out of shared memory at a large tile and many stages
                    row["error"] = str(e)[:200]
                    torch.cuda.synchronize()
                print(json.dumps(row), flush=True)
                if "ms" in row and (best[key]["ms"] is None or row["ms"] < best[key]["ms"]):
                    best[key] |= {k2: row[k2] for k2 in ("block_n", "block_k", "stages", "target", "plan", "ms")}
    for k2, v in saved.items():
        setattr(tg, k2, v)
    for key, row in best.items():
        if row["ms"]:
            row["speedup"] = row["flinear_ms"] / row["ms"]
        print("BEST", json.dumps(row))


if __name__ == "__main__":
    main()
