"""Rounding helpers shared by the Triton kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rnd(x, dt: tl.constexpr):
    """x (fp32) rounded to dt and back: torch's rounding of every intermediate bf16/fp16 result. bf16 by
    integer round-to-nearest-even on the bits (a plain to(bf16).to(fp32) pair can be folded away by the
    compiler, which then keeps fp32 precision where torch rounds)."""
    if dt == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    elif dt == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x
