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
# decode at batch 1 and 32; verify passes at batch 1 (k = 2) and 32 (k = 1 and 4)
SWEEP_TOKENS = [1, 3, 32, 64, 160]
SWEEP_SHAPE = "llama-3.1-8b"
# The sweep changes one launch setting at a time from the defaults, then times the best value of each together
SWEEP_VALUES = {"fp8_block_n": (32, 128), "fp8_block_k": (64, 256), "fp8_programs": (132, 528, 1056),
                "fp8_split_steps": (1, 2, 8), "fp8_stages": (2, 4), "fp8_warps": (2, 8), "fp8_block_m": (128, 256),
                "fp8_swap_tokens": (256,), "fp8_gemv_tokens": (0, 4), "fp8_gemv_block_n": (32, 128),
                "fp8_multi_tokens": (0, 64), "fp8_multi_block_k": (32, 128), "fp8_multi_block_n": (64, 256)}
SWEEP = [{}] + [{name: v} for name, values in SWEEP_VALUES.items() for v in values]


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


def sweep_settings(cases, sweep: list[dict], variants: list[dict] = (), one_at_a_time: bool = True) -> dict:
    """Each SWEEP variant's total time over the cases (name, tokens, x, w8, scale), then the best value of each
    setting together, then each of `variants` (whole settings); appends a row per case and variant to `sweep` and
    returns the summary. Without `one_at_a_time`: the defaults and the variants only."""
    from engine_ext.kernels.triton_fp8 import fp8_linear_triton

    def total(values: dict) -> float:
        settings = KernelSettings(**values)
        out = 0.0
        for name, m, x, w8, scale in cases:
            try:
                ms = timed(lambda: fp8_linear_triton(x, w8, scale, settings=settings))
            except Exception as e:  # a tile the chip cannot hold
                print("sweep", values, repr(e)[:200], flush=True)
                ms = float("inf")
            sweep.append(dict(product=name, tokens=m, ms=ms, **values))
            out += ms
        print("sweep", json.dumps(values), "%.4f ms" % out, flush=True)
        return out

    totals = {json.dumps(v): total(v) for v in (SWEEP if one_at_a_time else [{}])}
    best = {}
    for name, values in SWEEP_VALUES.items() if one_at_a_time else ():
        # each setting's value with the least total, the default's included
        options = [(totals["{}"], None)] + [(totals[json.dumps({name: v})], v) for v in values]
        if min(options, key=lambda o: o[0])[1] is not None:
            best[name] = min(options, key=lambda o: o[0])[1]
    if best:
        totals[json.dumps(best)] = total(best)
    for values in variants:
        totals[json.dumps(values)] = total(values)
    return {"sweep_best": sorted(totals.items(), key=lambda kv: kv[1])[:8], "sweep_default_ms": totals["{}"],
            "sweep_combined": best}


def main() -> None:
    from engine_ext.kernels.triton_fp8 import fp8_linear_triton, launch_config

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["llama-3.2-1b", "llama-3.1-8b"])
    ap.add_argument("--tokens", nargs="+", type=int, default=TOKENS)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--variants", nargs="*", type=json.loads, default=[],
                    help="with --sweep: whole KernelSettings (JSON objects) timed after the one-at-a-time sweep")
    ap.add_argument("--variants-only", action="store_true", help="with --sweep: the defaults and --variants only")
    ap.add_argument("--sweep-tokens", nargs="+", type=int, default=SWEEP_TOKENS,
                    help="with --sweep: the token counts swept (of --tokens)")
    ap.add_argument("--no-scaled-mm", action="store_true", help="time only the bf16 product and the W8A16 GEMM")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = "cuda"
    rows, sweep, cases = [], [], []
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
                if not args.no_scaled_mm:
                    try:
                        xq, xs = quantize_rows(x)
                        ws = scale[None, :].contiguous()

                        def mm():
                            return torch._scaled_mm(xq, w8t, scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)

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
                if args.sweep and m in args.sweep_tokens and shape == SWEEP_SHAPE:
                    cases.append((name, m, x, w8, scale))
    summary = sweep_settings(cases, sweep, args.variants, not args.variants_only) if cases else {}
    out = {"machine": machine(), "commit": commit(), "rows": rows, "sweep": sweep, **summary}
    print(json.dumps(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
