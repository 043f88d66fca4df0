"""Helpers of the kernels that fold LoRA into the element-wise work (triton_fused.py a token a program,
triton_grouped.py a run of a sequence's tokens a program): the rank-space input of a token's expand, and one
expand row."""

from __future__ import annotations

import triton
import triton.language as tl

from .rounding import rnd as _rnd


def rank_block(r: int) -> int:
    """The rank columns of a tile: r rounded up to a power of two."""
    return triton.next_power_of_2(max(r, 1))


@triton.jit
def lora_row(part_ptr, scale_ptr, slot, t, seg, R, num_splits, stride_ps, stride_pt, stride_ss,
             SPLITS: tl.constexpr, BLOCK_R: tl.constexpr, dt: tl.constexpr):
    """(sum_s part[s, t, seg*R:(seg+1)*R]) * scale[slot, seg], rounded to dt (as the expand's input): [BLOCK_R]
    fp32. All splits in one 2-D load (a loop over them would wait on each load in turn)."""
    offs_s = tl.arange(0, SPLITS)
    offs_r = tl.arange(0, BLOCK_R)
    mask = (offs_s[:, None] < num_splits) & (offs_r[None, :] < R)
    parts = tl.load(part_ptr + offs_s[:, None] * stride_ps + t * stride_pt + seg * R + offs_r[None, :], mask=mask,
                    other=0.0)
    return _rnd(tl.sum(parts, axis=0) * tl.load(scale_ptr + slot * stride_ss + seg).to(tl.float32), dt)


@triton.jit
def expand_row(s, b_ptr, slot, R, col0, col_end, stride_bs, stride_br, NCOL: tl.constexpr, BLOCK_R: tl.constexpr):
    """delta[c] = s @ B[slot, :, col0 + c] for c < NCOL and col0 + c < col_end (fp32; zero beyond col_end)."""
    offs_r = tl.arange(0, BLOCK_R)
    offs_c = col0 + tl.arange(0, NCOL)
    bv = tl.load(b_ptr + slot * stride_bs + offs_r[:, None] * stride_br + offs_c[None, :],
                 mask=(offs_r[:, None] < R) & (offs_c[None, :] < col_end), other=0.0)
    return tl.sum(s[:, None] * bv.to(tl.float32), axis=0)
