"""Fused element-wise work of the decoder layer in Triton: the kernels between the matrix products,
with the batched LoRA math folded in where a kernel already holds the tensor it needs.

At small batches a decode step is bound by the number of kernels, not by bytes: the plain-torch
layer (model.TorchOps) runs about 36 small kernels per layer for the norms, the rotary embedding,
the KV-cache write, SiLU and the residual adds, and a separate shrink and expand launch per LoRA
module. These kernels do the same work in four launches per layer (plus three for the o and
down LoRA deltas, which run on a side stream beside the o and down products), rounding where torch
rounds (each bf16 operation's result is rounded to bf16 before the next one reads it):

- add_rms_norm:  x = x + delta (rounded; with `extra`, delta = delta + extra rounded first: the o or down
                 LoRA delta computed beside its product), h = weight * rms_norm(x); with `lora`, also the shrink
                 h @ A[slot] of the group that reads h (q/k/v or gate/up), split over K
                                                     grid (tokens, K chunks)
- rope_write_kv: with `lora`, add the q/k/v expand (part @ B[slot] * scale) to its head's columns;
                 rotate q in place in the fused qkv output, rotate k, write k and v into the paged
                 cache at each token's slot          grid (tokens, heads)
- silu_mul:      with `lora`, add the gate/up expand; act = silu(gate) * up; with `lora`, also the
                 down shrink act @ A_down[slot], split over column blocks   grid (tokens, column blocks)

LoRA arguments are (A [S, in, nseg*R], B [S, R, out_total], scale [S, nseg], token slots [T]) for
one layer's group, as AdapterSlots' group views give them; the last slot is the zero slot, whose
tokens skip the LoRA math. Partial shrink results are fp32 [splits, T, nseg*R], summed by the
expand that reads them (lora_expand's layout).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .pdl import launch as _launch
from .pdl import wait_then_release as _wait_then_release
from .rounding import rnd as _rnd
from .settings import KernelSettings
from .triton_fp8 import BYTES_BOUND_M, linear_triton
from .triton_lora import expand_delta, group_delta, lora_delta, slot_rank
from .triton_lora import masks_ranks as _masks

_DEFAULTS = KernelSettings()
_SILU_BLOCK = 1024  # columns of one silu_mul program without LoRA


def _rank_block(r: int) -> int:
    return triton.next_power_of_2(max(r, 1))


@triton.jit
def _add_rms_norm_kernel(x_ptr, d_ptr, e_ptr, w_ptr, res_ptr, out_ptr, rows_ptr, N, eps, stride_x, stride_d,
                         stride_e, stride_r, stride_o,
                         a_ptr, slots_ptr, part_ptr, ranks_ptr, RT, R_SEG, skip_slot, stride_as, stride_ak, stride_ps,
                         stride_pt, stride_rk, HAS_DELTA: tl.constexpr, HAS_EXTRA: tl.constexpr, LORA: tl.constexpr,
                         BLOCK: tl.constexpr, CHUNK: tl.constexpr, BK: tl.constexpr, BLOCK_R: tl.constexpr,
                         ROWS: tl.constexpr, RANKS: tl.constexpr, PDL: tl.constexpr):
    _wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)  # the output row (and, without ROWS, the input row)
    src_row = row
    if ROWS:  # the input row the output row reads
        src_row = tl.load(rows_ptr + row).to(tl.int64)
    split = tl.program_id(1)
    dt = out_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    m = offs < N
    offs_r = tl.arange(0, BLOCK_R)
    # rstd over the whole row (every split recomputes it; the row is a few KB)
    x = tl.load(x_ptr + src_row * stride_x + offs, mask=m, other=0.0)
    if HAS_DELTA:
        d = tl.load(d_ptr + src_row * stride_d + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_EXTRA:
            d = _rnd(d + tl.load(e_ptr + src_row * stride_e + offs, mask=m, other=0.0), dt)
        x = _rnd(x.to(tl.float32) + d, dt)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    slot = 0
    do_lora = False
    mr = offs_r < RT
    if LORA:
        slot = tl.load(slots_ptr + row).to(tl.int64)
        do_lora = slot != skip_slot
        # each module's first `rank` of its R_SEG columns: the rest of the slot's A is zero padding
        mr = mr & (offs_r % R_SEG < slot_rank(ranks_ptr, stride_rk, slot, R_SEG, RANKS))
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for kk in range(0, CHUNK, BK):
        cols = split * CHUNK + kk + tl.arange(0, BK)
        mc = cols < N
        xc = tl.load(x_ptr + src_row * stride_x + cols, mask=mc, other=0.0)
        if HAS_DELTA:
            dc = tl.load(d_ptr + src_row * stride_d + cols, mask=mc, other=0.0).to(tl.float32)
            if HAS_EXTRA:
                dc = _rnd(dc + tl.load(e_ptr + src_row * stride_e + cols, mask=mc, other=0.0), dt)
            xc = (xc.to(tl.float32) + dc).to(dt)
        if HAS_DELTA or ROWS:
            tl.store(res_ptr + row * stride_r + cols, xc, mask=mc)
        wc = tl.load(w_ptr + cols, mask=mc, other=0.0).to(tl.float32)
        h = (wc * _rnd(xc.to(tl.float32) * rstd, dt)).to(dt)
        tl.store(out_ptr + row * stride_o + cols, h, mask=mc)
        if do_lora:
            av = tl.load(a_ptr + slot * stride_as + cols[:, None] * stride_ak + offs_r[None, :],
                         mask=mc[:, None] & mr[None, :], other=0.0)
            acc += tl.sum(h.to(tl.float32)[:, None] * av.to(tl.float32), axis=0)
    if do_lora:
        tl.store(part_ptr + split * stride_ps + row * stride_pt + offs_r, acc, mask=offs_r < RT)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, lora=None,
                 extra: torch.Tensor | None = None, rows: torch.Tensor | None = None, *,
                 settings: KernelSettings = _DEFAULTS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(x + delta, weight * rms_norm(x + delta), LoRA shrink partials or None); with delta None, x itself.

    `lora`: (A [S, N, RT], slots [T]) or (A, slots, ranks [S] int32, R): also part[s, t] = h[t, chunk s] @
    A[slot[t], chunk s], reading each module's first ranks[slot] of its R columns (the rest is zero padding).
    `extra` (float32 [T, N], needs delta): delta + extra, rounded to x's dtype, is what is added to x.
    `rows` (integer [M], without lora): only those rows, in that order (x[rows], delta[rows], extra[rows]
    without the gathers); the results then have M rows."""
    n = x.shape[1]
    if extra is not None and (delta is None or extra.shape != x.shape or extra.dtype != torch.float32
                              or extra.stride(1) != 1):
        raise ValueError(f"add_rms_norm: extra must be float32 {tuple(x.shape)} beside a delta, "
                         f"got {None if extra is None else (tuple(extra.shape), extra.dtype)}")
    if rows is not None and lora is not None:
        raise ValueError("add_rms_norm: rows and lora do not go together")
    num_tokens = x.shape[0] if rows is None else rows.shape[0]
    out = x.new_empty(num_tokens, n)
    if rows is not None:
        res = x.new_empty(num_tokens, n)  # x[rows] (+ delta[rows]), as the row gathers would give it
    else:
        res = torch.empty_like(x) if delta is not None else x
    block = triton.next_power_of_2(n)
    splits = triton.cdiv(n, settings.norm_chunk) if lora is not None else 1
    chunk = settings.norm_chunk if lora is not None else block
    part = None
    ranks = None
    if lora is not None:
        a, slots, *ranked = lora
        ranks, r_seg = ranked if ranked else (None, a.shape[2])
        rt = a.shape[2]
        block_r = _rank_block(rt)
        part = torch.empty(splits, num_tokens, rt, dtype=torch.float32, device=x.device)
        bk = settings.norm_lora_bk or max(16, min(chunk, 8192 // block_r))
        lora_args = (a, slots, part, ranks if ranks is not None else slots, rt, r_seg, a.shape[0] - 1, a.stride(0),
                     a.stride(1), part.stride(0), part.stride(1), ranks.stride(0) if ranks is not None else 0)
    else:
        block_r, bk = 1, min(chunk, 2048)
        lora_args = (x, x, x, x, 0, 1, 0, 0, 0, 0, 0, 0)
    if num_tokens:
        _add_rms_norm_kernel[(num_tokens, splits)](
            x, delta if delta is not None else x, extra if extra is not None else x, weight, res, out,
            rows if rows is not None else x, n, eps,
            x.stride(0), delta.stride(0) if delta is not None else 0, extra.stride(0) if extra is not None else 0,
            res.stride(0), out.stride(0), *lora_args,
            HAS_DELTA=delta is not None, HAS_EXTRA=extra is not None, LORA=lora is not None,
            BLOCK=block, CHUNK=chunk, BK=bk, BLOCK_R=block_r, ROWS=rows is not None, RANKS=_masks(ranks, settings),
            **_launch(num_tokens, x.device, settings.pdl_max_tokens),
            num_warps=settings.norm_lora_warps if lora is not None else min(16, max(1, block // 256)))
    return res, out, part


@triton.jit
def _lora_row(part_ptr, scale_ptr, slot, t, seg, R, num_splits, stride_ps, stride_pt, stride_ss,
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
def _expand_row(s, b_ptr, slot, R, col0, col_end, stride_bs, stride_br, NCOL: tl.constexpr, BLOCK_R: tl.constexpr):
    """delta[c] = s @ B[slot, :, col0 + c] for c < NCOL and col0 + c < col_end (fp32; zero beyond col_end)."""
    offs_r = tl.arange(0, BLOCK_R)
    offs_c = col0 + tl.arange(0, NCOL)
    bv = tl.load(b_ptr + slot * stride_bs + offs_r[:, None] * stride_br + offs_c[None, :],
                 mask=(offs_r[:, None] < R) & (offs_c[None, :] < col_end), other=0.0)
    return tl.sum(s[:, None] * bv.to(tl.float32), axis=0)


@triton.jit
def _rope_write_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, k_ptr, v_ptr, slot_ptr, num_heads, num_kv_heads,
                          stride_t, stride_c, stride_s, stride_kb, stride_ks, stride_kh,
                          part_ptr, b_ptr, scale_ptr, lslots_ptr, ranks_ptr, R, num_splits, skip_slot,
                          stride_ps, stride_pt, stride_bs, stride_br, stride_ss, stride_rk, e_ptr, stride_e,
                          PAGE: tl.constexpr, HALF: tl.constexpr, LORA: tl.constexpr, BLOCK_R: tl.constexpr,
                          SPLITS: tl.constexpr, POS: tl.constexpr, RANKS: tl.constexpr, EXTRA: tl.constexpr,
                          PDL: tl.constexpr):
    _wait_then_release(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cs = t  # the token's row of cos/sin: its own, or with POS (tables over positions) its position's
    if POS:
        cs = tl.load(pos_ptr + t).to(tl.int64)
    offs = tl.arange(0, HALF)
    src = qkv_ptr + t * stride_t + h * (2 * HALF)
    dt = qkv_ptr.dtype.element_ty
    x1 = tl.load(src + offs)
    x2 = tl.load(src + HALF + offs)
    if LORA:
        lslot = tl.load(lslots_ptr + t).to(tl.int64)
        if lslot != skip_slot:
            seg = (h >= num_heads).to(tl.int32) + (h >= num_heads + num_kv_heads).to(tl.int32)
            col = h * (2 * HALF)
            s = _lora_row(part_ptr, scale_ptr, lslot, t, seg, R, num_splits, stride_ps, stride_pt, stride_ss,
                          SPLITS, BLOCK_R, dt)
            rank = slot_rank(ranks_ptr, stride_rk, lslot, R, RANKS)  # B's rows past it are zero padding
            d1 = _expand_row(s, b_ptr, lslot, rank, col, col + HALF, stride_bs, stride_br, HALF, BLOCK_R)
            d2 = _expand_row(s, b_ptr, lslot, rank, col + HALF, col + 2 * HALF, stride_bs, stride_br, HALF, BLOCK_R)
            x1 = (x1.to(tl.float32) + d1).to(dt)
            x2 = (x2.to(tl.float32) + d2).to(dt)
    if EXTRA:  # the q/k/v LoRA delta computed beside the product (float32)
        e = e_ptr + t * stride_e + h * (2 * HALF)
        x1 = (x1.to(tl.float32) + tl.load(e + offs)).to(dt)
        x2 = (x2.to(tl.float32) + tl.load(e + HALF + offs)).to(dt)
    if h < num_heads + num_kv_heads:
        # torch: x * cos + cat(-x2, x1) * sin, every product and the sum rounded to the model dtype
        c1 = tl.load(cos_ptr + cs * stride_c + offs).to(tl.float32)
        c2 = tl.load(cos_ptr + cs * stride_c + HALF + offs).to(tl.float32)
        s1 = tl.load(sin_ptr + cs * stride_s + offs).to(tl.float32)
        s2 = tl.load(sin_ptr + cs * stride_s + HALF + offs).to(tl.float32)
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        o1 = (_rnd(f1 * c1, dt) + _rnd(-f2 * s1, dt)).to(dt)
        o2 = (_rnd(f2 * c2, dt) + _rnd(f1 * s2, dt)).to(dt)
        if h < num_heads:
            tl.store(src + offs, o1)
            tl.store(src + HALF + offs, o2)
        else:
            slot = tl.load(slot_ptr + t).to(tl.int64)
            dst = k_ptr + (slot // PAGE) * stride_kb + (slot % PAGE) * stride_ks + (h - num_heads) * stride_kh
            tl.store(dst + offs, o1.to(k_ptr.dtype.element_ty))
            tl.store(dst + HALF + offs, o2.to(k_ptr.dtype.element_ty))
    else:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        dst = (v_ptr + (slot // PAGE) * stride_kb + (slot % PAGE) * stride_ks
               + (h - num_heads - num_kv_heads) * stride_kh)
        tl.store(dst + offs, x1.to(v_ptr.dtype.element_ty))
        tl.store(dst + HALF + offs, x2.to(v_ptr.dtype.element_ty))


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                  lora=None, positions: torch.Tensor | None = None, extra: torch.Tensor | None = None, *,
                  settings: KernelSettings = _DEFAULTS) -> torch.Tensor:
    """Rotate q and k of the fused [T, (H + 2 KVH) * D] qkv output, write k and v into the paged cache at
    `slot_mapping`; returns q as a [T, H, D] view of qkv (rotated in place). cos/sin are [T, D], or with
    `positions` [T] tables over positions ([P, D], P above every position; CausalLM.build_rope_table).

    `lora`: (part [splits, T, 3R] from add_rms_norm, B [S, R, qkv width], scale [S, 3], slots [T][, ranks [S]
    int32]): the q/k/v LoRA deltas are added first (to the q columns of qkv too), from B's first ranks[slot] rows.
    `extra` (float32 [T, qkv width], without lora): the deltas themselves (triton_lora.group_delta), added first."""
    if extra is not None and (lora is not None or extra.stride(1) != 1):
        raise ValueError("rope_write_kv takes the q/k/v deltas as lora or as a unit-stride extra, not both")
    num_tokens, width = qkv.shape
    head_dim = width // (num_heads + 2 * num_kv_heads)
    if qkv.stride(1) != 1 or cos.stride(1) != 1 or sin.stride(1) != 1 or k_cache.stride(3) != 1:
        raise ValueError("rope_write_kv needs unit stride along the feature dimension")
    if head_dim & (head_dim - 1) or k_cache.stride() != v_cache.stride():
        raise ValueError("rope_write_kv needs a power-of-two head_dim and identically laid out K/V caches")
    ranks = None
    if lora is not None:
        part, b, scale, lslots, *ranked = lora
        ranks = ranked[0] if ranked else None
        rank = b.shape[1]
        lora_args = (part, b, scale, lslots, ranks if ranks is not None else lslots, rank, part.shape[0],
                     b.shape[0] - 1, part.stride(0), part.stride(1), b.stride(0), b.stride(1), scale.stride(0),
                     ranks.stride(0) if ranks is not None else 0)
        block_r = _rank_block(rank)
    else:
        lora_args, block_r = (qkv, qkv, qkv, qkv, qkv, 0, 0, 0, 0, 0, 0, 0, 0, 0), 1
    if num_tokens:
        _rope_write_kv_kernel[(num_tokens, num_heads + 2 * num_kv_heads)](
            qkv, cos, sin, positions if positions is not None else slot_mapping, k_cache, v_cache, slot_mapping,
            num_heads, num_kv_heads,
            qkv.stride(0), cos.stride(0), sin.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            *lora_args, qkv if extra is None else extra, 0 if extra is None else extra.stride(0),
            PAGE=k_cache.shape[1], HALF=head_dim // 2, LORA=lora is not None, BLOCK_R=block_r,
            SPLITS=triton.next_power_of_2(lora_args[6] or 1), POS=positions is not None, RANKS=_masks(ranks, settings),
            EXTRA=extra is not None,
            **_launch(num_tokens, qkv.device, settings.pdl_max_tokens),
            num_warps=1 if lora is None else settings.rope_lora_warps)
    return qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, N, stride_g, stride_o,
                     part_ptr, b_ptr, scale_ptr, slots_ptr, a_ptr, dpart_ptr, ranks_ptr, dranks_ptr, R, num_splits,
                     R2, skip_slot, stride_ps, stride_pt, stride_bs, stride_br, stride_ss, stride_as, stride_ak,
                     stride_ds, stride_dt, stride_rk, stride_drk, e_ptr, stride_e, BLOCK: tl.constexpr,
                     SB: tl.constexpr, LORA: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_R2: tl.constexpr,
                     SPLITS: tl.constexpr, RANKS: tl.constexpr, EXTRA: tl.constexpr, PDL: tl.constexpr):
    _wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    nb = tl.program_id(1)
    dt = out_ptr.dtype.element_ty
    slot = 0
    do_lora = False
    if LORA:
        slot = tl.load(slots_ptr + row).to(tl.int64)
        do_lora = slot != skip_slot
    offs_r2 = tl.arange(0, BLOCK_R2)
    dacc = tl.zeros([BLOCK_R2], dtype=tl.float32)
    sg = tl.zeros([BLOCK_R], dtype=tl.float32)
    su = tl.zeros([BLOCK_R], dtype=tl.float32)
    rank, rank2 = R, R2  # the rows of B_gate_up and columns of A_down the slot's adapter fills (the rest is zero)
    if LORA:
        rank = slot_rank(ranks_ptr, stride_rk, slot, R, RANKS)
        rank2 = slot_rank(dranks_ptr, stride_drk, slot, R2, RANKS)
    if do_lora:
        sg = _lora_row(part_ptr, scale_ptr, slot, row, 0, R, num_splits, stride_ps, stride_pt, stride_ss, SPLITS,
                       BLOCK_R, dt)
        su = _lora_row(part_ptr, scale_ptr, slot, row, 1, R, num_splits, stride_ps, stride_pt, stride_ss, SPLITS,
                       BLOCK_R, dt)
    for c0 in range(0, BLOCK, SB):
        cols = nb * BLOCK + c0 + tl.arange(0, SB)
        m = cols < N
        g = tl.load(gu_ptr + row * stride_g + cols, mask=m, other=0.0)
        u = tl.load(gu_ptr + row * stride_g + N + cols, mask=m, other=0.0)
        if do_lora:
            dg = _expand_row(sg, b_ptr, slot, rank, nb * BLOCK + c0, N, stride_bs, stride_br, SB, BLOCK_R)
            du = _expand_row(su, b_ptr, slot, rank, N + nb * BLOCK + c0, 2 * N, stride_bs, stride_br, SB, BLOCK_R)
            g = (g.to(tl.float32) + dg).to(dt)
            u = (u.to(tl.float32) + du).to(dt)
        if EXTRA:  # the gate/up LoRA delta computed beside the product (float32)
            g = (g.to(tl.float32) + tl.load(e_ptr + row * stride_e + cols, mask=m, other=0.0)).to(dt)
            u = (u.to(tl.float32) + tl.load(e_ptr + row * stride_e + N + cols, mask=m, other=0.0)).to(dt)
        gf = g.to(tl.float32)
        act = (_rnd(gf / (1.0 + tl.exp(-gf)), dt) * u.to(tl.float32)).to(dt)
        tl.store(out_ptr + row * stride_o + cols, act, mask=m)
        if do_lora:
            av = tl.load(a_ptr + slot * stride_as + cols[:, None] * stride_ak + offs_r2[None, :],
                         mask=m[:, None] & (offs_r2[None, :] < rank2), other=0.0)
            dacc += tl.sum(act.to(tl.float32)[:, None] * av.to(tl.float32), axis=0)
    if do_lora:
        tl.store(dpart_ptr + nb * stride_ds + row * stride_dt + offs_r2, dacc, mask=offs_r2 < R2)


def silu_mul(gate_up: torch.Tensor, lora=None, extra: torch.Tensor | None = None, *,
             settings: KernelSettings = _DEFAULTS) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(silu(gate_up[:, :N]) * gate_up[:, N:]  [T, N], down-shrink partials or None).

    `lora`: (part [splits, T, 2R] from add_rms_norm, B_gate_up [S, R, 2N], scale [S, 2], A_down [S, N, R2],
    slots [T][, ranks, down_ranks: [S] int32]): the gate/up deltas are added before the activation, and
    part_down[c, t] = act[t, block c] @ A_down[slot[t], block c] is returned for lora_expand; with the ranks, only
    B_gate_up's first ranks[slot] rows and A_down's first down_ranks[slot] columns are read (the rest is zero).
    `extra` (float32 [T, 2N], without lora): the gate/up deltas themselves (triton_lora.group_delta), added first."""
    if extra is not None and (lora is not None or extra.stride(1) != 1):
        raise ValueError("silu_mul takes the gate/up deltas as lora or as a unit-stride extra, not both")
    num_tokens, width = gate_up.shape
    n = width // 2
    if gate_up.stride(1) != 1:
        raise ValueError("silu_mul needs unit stride along the feature dimension")
    out = torch.empty(num_tokens, n, dtype=gate_up.dtype, device=gate_up.device)
    block = min(_SILU_BLOCK if lora is None else settings.silu_lora_block, triton.next_power_of_2(n))
    nblocks = triton.cdiv(n, block)
    dpart = None
    ranks = down_ranks = None
    if lora is not None:
        part, b, scale, a_down, slots, *ranked = lora
        ranks, down_ranks = ranked if ranked else (None, None)
        rank, r2 = b.shape[1], a_down.shape[2]
        block_r, block_r2 = _rank_block(rank), _rank_block(r2)
        sb = min(block, settings.silu_lora_sb or max(16, min(block, 8192 // max(block_r, block_r2))))
        dpart = torch.empty(nblocks, num_tokens, r2, dtype=torch.float32, device=gate_up.device)
        lora_args = (part, b, scale, slots, a_down, dpart, ranks if ranks is not None else slots,
                     down_ranks if down_ranks is not None else slots, rank, part.shape[0], r2, b.shape[0] - 1,
                     part.stride(0), part.stride(1), b.stride(0), b.stride(1), scale.stride(0), a_down.stride(0),
                     a_down.stride(1), dpart.stride(0), dpart.stride(1), ranks.stride(0) if ranks is not None else 0,
                     down_ranks.stride(0) if down_ranks is not None else 0)
    else:
        block_r = block_r2 = 1
        sb = block
        lora_args = (gate_up,) * 8 + (0,) * 15
    if num_tokens:
        _silu_mul_kernel[(num_tokens, nblocks)](gate_up, out, n, gate_up.stride(0), out.stride(0), *lora_args,
                                                gate_up if extra is None else extra,
                                                0 if extra is None else extra.stride(0),
                                                BLOCK=block, SB=sb, LORA=lora is not None, BLOCK_R=block_r,
                                                BLOCK_R2=block_r2, SPLITS=triton.next_power_of_2(lora_args[9] or 1),
                                                RANKS=_masks(ranks, settings), EXTRA=extra is not None,
                                                **_launch(num_tokens, gate_up.device, settings.pdl_max_tokens),
                                                num_warps=settings.silu_lora_warps if lora is not None else 4)
    return out, dpart


class SideBranch:
    """Kernels queued on a second stream of the device, in parallel with the main stream's next ones (inside a
    CUDA graph capture: a parallel branch of the graph). `with branch:` forks: the side stream waits for what
    the main stream has queued so far and becomes the current stream; `branch.join()` makes the main stream
    wait for what the side stream has queued. Off a CUDA device (the Triton interpreter) both are no-ops."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._main = self._ctx = None

    def __enter__(self) -> SideBranch:
        if self.stream is not None:
            self._main = torch.cuda.current_stream(self.stream.device)
            self.stream.wait_stream(self._main)
            self._ctx = torch.cuda.stream(self.stream)
            self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
            self._ctx = None

    def join(self) -> None:
        if self._main is not None:
            self._main.wait_stream(self.stream)


class TritonOps:
    """model.TorchOps' contract in the fused kernels above, launched with `settings`. It takes the LoRA math
    (`fuses_lora`) of the forwards `settings.lora_path` names: "fold" (decode steps, verify passes, prompts in
    graph-sized passes), where the model passes the LoRA arguments to the element-wise kernels and computes the o
    and down LoRA deltas (`lora_delta`, `expand_delta`: float32 buffers) on `side_branch` beside their products,
    for the next add_rms_norm's `extra`; "beside", where every group's delta is such a buffer (`group_delta`,
    `lora_delta`), added by the rotary, SiLU and norm kernels.

    The products are cuBLAS's (F.linear): at decode sizes it is faster than a split-K Triton GEMM with the
    LoRA expands in its epilogue for every product but the LM head (`git show 211e305:bench/RESULTS.md`). Products
    of `settings.triton_linear_tokens` to 256 tokens may take triton_fp8's split-K GEMM instead (off by default)."""

    fuses_lora = True

    def __init__(self, settings: KernelSettings, device: torch.device):
        self.settings = settings
        self.side_branch = SideBranch(device)  # one side stream per engine, made before any graph capture
        # the products: cuBLAS's, or by their tokens (triton_linear_tokens) cuBLAS's or the split-K Triton GEMM
        self.linear = self._linear_by_tokens if settings.triton_linear_tokens else F.linear

    def lora_path(self, num_tokens: int, multi: bool, rank: int, columns: int) -> str:
        return self.settings.lora_path(num_tokens, multi, rank, columns)

    def _linear_by_tokens(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                          ) -> torch.Tensor:
        if self.settings.triton_linear_tokens <= x.shape[0] <= BYTES_BOUND_M and x.dim() == 2 and weight.stride(1) == 1:
            return linear_triton(x, weight, bias, settings=self.settings)
        return F.linear(x, weight, bias)

    def add_rms_norm(self, x, delta, weight, eps, lora=None, extra=None, rows=None):
        return add_rms_norm(x, delta, weight, eps, lora, extra, rows, settings=self.settings)

    def rope_write_kv(self, qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, lora=None,
                      positions=None, extra=None):
        return rope_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, lora, positions,
                             extra, settings=self.settings)

    def silu_mul(self, gate_up, lora=None, extra=None):
        return silu_mul(gate_up, lora, extra, settings=self.settings)

    def _run_tokens(self, multi: bool) -> int:
        return self.settings.multi_run_tokens if multi else 1

    def lora_delta(self, x, a, b, scale, slots, ranks=None, multi=False):
        """One module's delta ([T, out] float32); `multi`: the forward has several tokens of a sequence."""
        return lora_delta(x, a, b, scale, slots, ranks, run_tokens=self._run_tokens(multi), settings=self.settings)

    def group_delta(self, x, a, b, scale, slots, segments, ranks=None, multi=False):
        """A fused group's deltas ([T, out_total] float32)."""
        return group_delta(x, a, b, scale, slots, segments, ranks, run_tokens=self._run_tokens(multi),
                           settings=self.settings)

    def expand_delta(self, part, b, scale, slots, ranks=None):
        return expand_delta(part, b, scale, slots, ranks, settings=self.settings)
