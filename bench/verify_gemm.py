"""The base model's products at verify-pass sizes on the GPU: how cuBLAS's bf16 product (F.linear, as every forward
runs it) scales from a decode step's tokens to a verify pass's, against the weights' bytes, for the decoder layers'
products of the 1B and 8B shapes. A verify pass at batch 32 with k = 4 drafts is 160 tokens; the base model alone over
them took 1.98 ms on an H100 at 1B against 1.54 for the decode step (bench/RESULTS.md section 1), and the products are
bound by their weights' bytes at both sizes. Beside F.linear each product is also timed in the other orientation
(`torch.mm(w, x.T).T`: cuBLAS is asked for the transposed problem and may pick other tiles), through cuBLASLt, with
its tokens split in two products, and as triton_fp8's split-K GEMM over the bf16 weights (`linear_triton`, plain and
with transposed tiles: what `KernelSettings.triton_linear_tokens` switches on); each time is a CUDA-graph replay
(triton.testing's do_bench_cudagraph), GB/s the weight bytes read.

    python bench/verify_gemm.py --out verify_gemm.json [--tokens 32 64 96 128 160 192 256]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import commit, machine  # noqa: E402
from bench.fp8_gemm import products, timed  # noqa: E402
from engine_ext.kernels import KernelSettings  # noqa: E402

SWAPPED = KernelSettings(fp8_swap_tokens=256, fp8_block_m=128)

TOKENS = [32, 64, 96, 128, 144, 160, 192, 256]


def _with_cublaslt(fn):
    """fn run with cuBLASLt as torch's preferred BLAS (it applies when the product is launched, or captured)."""
    def run():
        before = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            return fn()
        finally:
            torch.backends.cuda.preferred_blas_library(before)
    return run


def variants(x: torch.Tensor, w: torch.Tensor) -> dict:
    """name -> a product of x [T, in] and w [out, in] giving y [T, out] (equal up to the summation order)."""
    from engine_ext.kernels.triton_fp8 import linear_triton

    half = x.shape[0] // 2
    return {
        "linear": lambda: F.linear(x, w),
        "linear_cublaslt": _with_cublaslt(lambda: F.linear(x, w)),
        "transposed": lambda: torch.mm(w, x.t()).t(),
        "transposed_contiguous": lambda: torch.mm(w, x.t()).t().contiguous(),
        "split_tokens": lambda: torch.cat([F.linear(x[:half], w), F.linear(x[half:], w)]),
        "triton": lambda: linear_triton(x, w),  # the split-K GEMM (KernelSettings.triton_linear_tokens)
        "triton_swapped": lambda: linear_triton(x, w, settings=SWAPPED),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["llama-3.2-1b", "llama-3.1-8b"])
    ap.add_argument("--tokens", nargs="+", type=int, default=TOKENS)
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = []
    for shape in args.shapes:
        for name, (n, k) in products(shape).items():
            g = torch.Generator("cuda").manual_seed(n + k)
            w = (torch.randn(n, k, generator=g, device="cuda") * k**-0.5).to(torch.bfloat16)
            for m in args.tokens:
                x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
                ref = F.linear(x.float(), w.float())
                row = dict(shape=shape, product=name, tokens=m, out=n, inn=k)
                for variant, fn in variants(x, w).items():
                    try:
                        err = ((fn().double() - ref.double()).norm() / ref.double().norm()).item()
                        ms = timed(fn)
                    except RuntimeError as e:  # a BLAS this torch build lacks
                        row[variant] = {"error": repr(e)[:200]}
                        continue
                    row[variant] = {"ms": ms, "gbs": 2 * n * k / ms / 1e6, "rel_err": err}
                rows.append(row)
                print(json.dumps({"shape": shape, "product": name, "tokens": m,
                                  **{v: round(r["ms"], 4) for v, r in row.items() if isinstance(r, dict) and "ms" in r}}),
                      flush=True)
    out = {"machine": machine(), "commit": commit(), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
