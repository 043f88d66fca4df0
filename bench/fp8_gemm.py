"""The FP8 weights' products alone on the GPU: the W8A16 Triton GEMM (kernels/triton_fp8.py) against the bf16
product it replaces (cuBLAS, F.linear) and `torch._scaled_mm` (FP8 x FP8, per-token activation scales, cuBLASLt;
timed with and without quantizing the activations), for the decoder layers' products of the 1B and 8B shapes at
decode, verify and prompt token counts. Each time is a CUDA-graph replay of one product (triton.testing's
do_bench_cudagraph); GB/s counts the weight bytes each reads. `--sweep` also times the GEMM under other launch
settings at the decode sizes, to choose KernelSettings' fp8 defaults. Prints one JSON object.

    python bench/fp8_gemm.py --out fp8_gemm.json [--sweep]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import SHAPES, commit, machine  # noqa: E402
from engine_ext.kernels import KernelSettings  # noqa: E402
from engine_ext.quantization import FP8_DTYPE, FP8_MAX, fp8_linear, quantize_fp8  # noqa: E402

TOKENS = [1, 8, 32, 64, 160, 512, 2048]
SWEEP_TOKENS = [1, 32]
SWEEP_SHAPE = "llama-3.1-8b"
SWEEP = ([dict(fp8_block_k=bk, fp8_stages=st, fp8_warps=4, fp8_block_n=bn)
          for bk in (128, 256, 512) for st in (3, 5) for bn in (0, 32)]
         + [dict(fp8_block_k=256, fp8_stages=4, fp8_warps=w, fp8_block_n=0) for w in (2, 4, 8)])


def products(shape: str) -> dict[str, tuple[int, int]]:
    """A decoder layer's fused products: name -> (out, in)."""
    hidden, inter, _, heads, kv_heads, _ = SHAPES[shape]
    head_dim = hidden // heads
    return {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden), "o": (hidden, hidden), "gate_up": (2 * inter, hidden),
            "down": (hidden, inter)}


def timed(fn) -> float:
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=30)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token e4m3 activations and their scales, as a W8A8 product would need them each step."""
    s = x.abs().amax(dim=1, keepdim=True).float().clamp_min(1e-12) / FP8_MAX
    return (x.float() / s).to(FP8_DTYPE), s


def main() -> None:
    from engine_ext.kernels.triton_fp8 import fp8_linear_triton, launch_config

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["llama-3.2-1b", "llama-3.1-8b"])
    ap.add_argument("--tokens", nargs="+", type=int, default=TOKENS)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = "cuda"
    rows, sweep = [], []
    for shape in args.shapes:
        for name, (n, k) in products(shape).items():
            g = torch.Generator(dev).manual_seed(n + k)
            w = (torch.randn(n, k, generator=g, device=dev) * k**-0.5).to(torch.bfloat16)
            w8, scale = quantize_fp8(w)
            w8t = w8.t()  # column-major [in, out], as _scaled_mm takes its second operand
            for m in args.tokens:
                x = torch.randn(m, k, generator=g, device=dev).to(torch.bfloat16)
                ref = fp8_linear(x.float(), w8, scale)
                y = fp8_linear_triton(x, w8, scale)
                err = ((y.double() - ref.double()).norm() / ref.double().norm()).item()
                bf16_ms = timed(lambda: F.linear(x, w))
                fp8_ms = timed(lambda: fp8_linear_triton(x, w8, scale))
                row = dict(shape=shape, product=name, tokens=m, out=n, inn=k, bf16_ms=bf16_ms, fp8_ms=fp8_ms,
                           speedup=bf16_ms / fp8_ms, fp8_gbs=n * k / fp8_ms / 1e6, bf16_gbs=2 * n * k / bf16_ms / 1e6,
                           rel_err=err, config=launch_config(m, n, k))
                try:
                    xq, xs = quantize_rows(x)
                    ws = scale[None, :].contiguous()
                    mm = lambda: torch._scaled_mm(xq, w8t, scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)  # noqa: E731
                    row["scaled_mm_ms"] = timed(mm)

                    def quantized_mm():  # the activations quantized each call, as a step would
                        q, qs = quantize_rows(x)
                        return torch._scaled_mm(q, w8t, scale_a=qs, scale_b=ws, out_dtype=torch.bfloat16)

                    row["scaled_mm_quant_ms"] = timed(quantized_mm)
                    row["scaled_mm_rel_err"] = ((mm().double() - ref.double()).norm() / ref.double().norm()).item()
                except Exception as e:  # shapes or scalings this torch's _scaled_mm refuses
                    row["scaled_mm_error"] = repr(e)[:200]
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.sweep and m in SWEEP_TOKENS and shape == SWEEP_SHAPE:
                    for values in SWEEP:
                        settings = KernelSettings(**values)
                        try:
                            ms = timed(lambda: fp8_linear_triton(x, w8, scale, settings=settings))
                        except Exception as e:  # a tile the chip cannot hold
                            print("sweep", values, repr(e)[:200], flush=True)
                            ms = float("inf")
                        sweep.append(dict(shape=shape, product=name, tokens=m, ms=ms, **values))
    summary = {}
    if sweep:  # each setting's total time over every swept product, best first
        totals: dict[str, float] = {}
        for r in sweep:
            key = json.dumps({k: r[k] for k in SWEEP[0]})
            totals[key] = totals.get(key, 0.0) + r["ms"]
        default = json.dumps({k: getattr(KernelSettings(), k) for k in SWEEP[0]})
        summary = {"sweep_best": sorted(totals.items(), key=lambda kv: kv[1])[:8], "sweep_default_ms": totals.get(default)}
    out = {"machine": machine(), "commit": commit(), "rows": rows, "sweep": sweep, **summary}
    print(json.dumps(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
