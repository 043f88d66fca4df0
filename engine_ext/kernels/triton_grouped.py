"""The LoRA-folding kernels of triton_fused.py over row groups: a program takes up to ROWS consecutive tokens on one
adapter slot (a verify pass's k+1 tokens of one sequence, a prompt's tokens, neighbours the scheduler grouped by
adapter), reads each adapter tile once for all of them and multiplies them as one tensor-core tile. A verify
pass then reads its adapters' weights once per sequence, as a decode step does, in as many launches.

    add_rms_norm:  x = x + delta (+ extra), h = w * rms_norm(x), part[s, t] = h[t, chunk s] @ A[slot, chunk s]
    rope_write_kv: qkv[t] += part[:, t] summed @ B[slot] * scale[slot]; rotary on q and k; k and v into the cache
    silu_mul:      gate_up[t] += part[:, t] summed @ B[slot] * scale[slot]; act = silu(gate) * up;
                   part_down[c, t] = act[t, block c] @ A_down[slot, block c]

A token leads a group when its slot differs from the previous token's or it starts an aligned block of ROWS tokens
(triton_lora._run_rows, found on the device): grids are sized by tokens, programs of non-leaders return at once, and
a CUDA graph captured once serves any mix. Contracts, rounding (each bf16 result rounded where torch rounds it) and
the partial-sum layouts are those of the per-token kernels, so a consumer of either producer's partials works; the
products sum in another order than the per-token kernels' (tensor-core tiles), a difference within bf16 rounding.
Base-only groups (the zero slot) do the element-wise work and skip the LoRA math.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch as _launch
from .pdl import wait_then_release as _wait_then_release
from .rounding import rnd as _rnd
from .settings import KernelSettings
from .triton_lora import _run_rows

_DEFAULTS = KernelSettings()


def _rank_block(r: int) -> int:
    """Rank columns of a tile: at least 16 (the smallest tensor-core dot), zero-padded."""
    return max(16, triton.next_power_of_2(max(r, 1)))


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b accumulated in fp32 (float32 operands in full precision, not tf32)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _residual(x_ptr, d_ptr, e_ptr, offs_t, cols, mask, stride_x, stride_d, stride_e,
              HAS_DELTA: tl.constexpr, HAS_EXTRA: tl.constexpr, dt: tl.constexpr):
    """x + delta (+ extra rounded into delta first) [rows, cols], rounded to dt as torch adds them."""
    x = tl.load(x_ptr + offs_t[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(d_ptr + offs_t[:, None] * stride_d + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_EXTRA:
            d = _rnd(d + tl.load(e_ptr + offs_t[:, None] * stride_e + cols[None, :], mask=mask, other=0.0), dt)
        x = (x.to(tl.float32) + d).to(dt)
    return x


@triton.jit
def _add_rms_norm_kernel(x_ptr, d_ptr, e_ptr, w_ptr, res_ptr, out_ptr, a_ptr, slots_ptr, part_ptr, T, N, RT, eps,
                         skip_slot, stride_x, stride_d, stride_e, stride_r, stride_o, stride_as, stride_ak, stride_ps,
                         stride_pt, HAS_DELTA: tl.constexpr, HAS_EXTRA: tl.constexpr, ROWS: tl.constexpr,
                         CHUNK: tl.constexpr, BK: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr,
                         PDL: tl.constexpr):
    _wait_then_release(PDL)
    t = tl.program_id(0)
    split = tl.program_id(1)
    slot, leader, first_rows, rows = _run_rows(slots_ptr, t, T, ROWS)
    if leader:
        dt = out_ptr.dtype.element_ty
        offs_t = first_rows.to(tl.int64)
        # rstd over each whole row (every split recomputes it from its rows: a few KB each)
        sq = tl.zeros([ROWS], dtype=tl.float32)
        for c0 in range(0, N, BK):
            cols = c0 + tl.arange(0, BK)
            xc = _residual(x_ptr, d_ptr, e_ptr, offs_t, cols, rows[:, None] & (cols[None, :] < N), stride_x,
                           stride_d, stride_e, HAS_DELTA, HAS_EXTRA, dt).to(tl.float32)
            sq += tl.sum(xc * xc, axis=1)
        rstd = 1.0 / tl.sqrt(sq / N + eps)
        do_lora = slot != skip_slot
        offs_r = tl.arange(0, BLOCK_R)
        acc = tl.zeros([ROWS, BLOCK_R], dtype=tl.float32)
        for kk in range(0, CHUNK, BK):
            cols = split * CHUNK + kk + tl.arange(0, BK)
            mc = cols < N
            mask = rows[:, None] & mc[None, :]
            xc = _residual(x_ptr, d_ptr, e_ptr, offs_t, cols, mask, stride_x, stride_d, stride_e, HAS_DELTA,
                           HAS_EXTRA, dt)
            if HAS_DELTA:
                tl.store(res_ptr + offs_t[:, None] * stride_r + cols[None, :], xc, mask=mask)
            wc = tl.load(w_ptr + cols, mask=mc, other=0.0).to(tl.float32)
            h = (wc[None, :] * _rnd(xc.to(tl.float32) * rstd[:, None], dt)).to(dt)
            tl.store(out_ptr + offs_t[:, None] * stride_o + cols[None, :], h, mask=mask)
            if do_lora:
                av = tl.load(a_ptr + slot * stride_as + cols[:, None] * stride_ak + offs_r[None, :],
                             mask=mc[:, None] & (offs_r[None, :] < RT), other=0.0)
                acc += _dot(h, av, IEEE)
        if do_lora:
            tl.store(part_ptr + split * stride_ps + offs_t[:, None] * stride_pt + offs_r[None, :], acc,
                     mask=rows[:, None] & (offs_r[None, :] < RT))


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, lora,
                 extra: torch.Tensor | None = None, *,
                 settings: KernelSettings = _DEFAULTS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x + delta, weight * rms_norm(x + delta), part) with part[s, t] = h[t, chunk s] @ A[slot[t], chunk s]
    (float32 [splits, T, RT]; rows of zero-slot tokens unset). `lora`: (A [S, N, RT], slots [T]); `extra`: as in
    triton_fused.add_rms_norm."""
    a, slots = lora
    num_tokens, n = x.shape
    if extra is not None and (delta is None or extra.shape != x.shape or extra.dtype != torch.float32
                              or extra.stride(1) != 1):
        raise ValueError("add_rms_norm: extra must be a float32 tensor shaped like x, beside a delta")
    rt = a.shape[2]
    chunk = settings.group_norm_chunk
    splits = triton.cdiv(n, chunk)
    out = x.new_empty(num_tokens, n)
    res = torch.empty_like(x) if delta is not None else x
    part = torch.empty(splits, num_tokens, rt, dtype=torch.float32, device=x.device)
    block_r = _rank_block(rt)
    bk = min(chunk, max(16, 4096 // block_r))
    if num_tokens:
        _add_rms_norm_kernel[(num_tokens, splits)](
            x, delta if delta is not None else x, extra if extra is not None else x, weight, res, out, a, slots,
            part, num_tokens, n, rt, eps, a.shape[0] - 1, x.stride(0), delta.stride(0) if delta is not None else 0,
            extra.stride(0) if extra is not None else 0, res.stride(0), out.stride(0), a.stride(0), a.stride(1),
            part.stride(0), part.stride(1), HAS_DELTA=delta is not None, HAS_EXTRA=extra is not None,
            ROWS=settings.group_rows, CHUNK=chunk, BK=bk, BLOCK_R=block_r, IEEE=x.dtype == torch.float32,
            num_warps=settings.group_warps, **_launch(num_tokens, x.device))
    return res, out, part


@triton.jit
def _lora_rows(part_ptr, scale_ptr, slot, offs_t, rows, seg, R, num_splits, stride_ps, stride_pt, stride_ss,
               SPLITS: tl.constexpr, BLOCK_R: tl.constexpr, ROWS: tl.constexpr, dt: tl.constexpr):
    """(sum_s part[s, rows, seg*R:(seg+1)*R]) * scale[slot, seg], rounded to dt (the expand's input):
    [ROWS, BLOCK_R] fp32, zero past R. Every split in one 3-D load (a loop would wait on each load in turn)."""
    offs_s = tl.arange(0, SPLITS)
    offs_r = tl.arange(0, BLOCK_R)
    mask = ((offs_s[:, None, None] < num_splits) & rows[None, :, None]) & (offs_r[None, None, :] < R)
    parts = tl.load(part_ptr + offs_s[:, None, None] * stride_ps + offs_t[None, :, None] * stride_pt + seg * R
                    + offs_r[None, None, :], mask=mask, other=0.0)
    return _rnd(tl.sum(parts, axis=0) * tl.load(scale_ptr + slot * stride_ss + seg).to(tl.float32), dt)


@triton.jit
def _expand(s, b_ptr, slot, R, col0, col_end, stride_bs, stride_br, NCOL: tl.constexpr, BLOCK_R: tl.constexpr,
            IEEE: tl.constexpr):
    """s [ROWS, BLOCK_R] @ B[slot, :, col0 : col0 + NCOL] (fp32; zero at columns from col_end). Tiles narrower than
    a tensor-core dot (heads of 16) multiply on the CUDA cores."""
    offs_r = tl.arange(0, BLOCK_R)
    offs_c = col0 + tl.arange(0, NCOL)
    bv = tl.load(b_ptr + slot * stride_bs + offs_r[:, None] * stride_br + offs_c[None, :],
                 mask=(offs_r[:, None] < R) & (offs_c[None, :] < col_end), other=0.0)
    if NCOL >= 16:
        return _dot(s.to(bv.dtype), bv, IEEE)
    return tl.sum(s[:, :, None] * bv.to(tl.float32)[None, :, :], axis=1)


@triton.jit
def _rope_write_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, k_ptr, v_ptr, kv_slot_ptr, T, num_heads, num_kv_heads,
                          stride_t, stride_c, stride_s, stride_kb, stride_ks, stride_kh,
                          part_ptr, b_ptr, scale_ptr, slots_ptr, R, num_splits, skip_slot,
                          stride_ps, stride_pt, stride_bs, stride_br, stride_ss,
                          PAGE: tl.constexpr, HALF: tl.constexpr, ROWS: tl.constexpr, BLOCK_R: tl.constexpr,
                          SPLITS: tl.constexpr, POS: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    _wait_then_release(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot, leader, first_rows, rows = _run_rows(slots_ptr, t, T, ROWS)
    if leader:
        offs_t = first_rows.to(tl.int64)
        offs = tl.arange(0, HALF)
        m = rows[:, None]
        src = qkv_ptr + offs_t[:, None] * stride_t + h * (2 * HALF) + offs[None, :]
        dt = qkv_ptr.dtype.element_ty
        x1 = tl.load(src, mask=m, other=0.0)
        x2 = tl.load(src + HALF, mask=m, other=0.0)
        if slot != skip_slot:
            seg = (h >= num_heads).to(tl.int32) + (h >= num_heads + num_kv_heads).to(tl.int32)
            col = h * (2 * HALF)
            s = _lora_rows(part_ptr, scale_ptr, slot, offs_t, rows, seg, R, num_splits, stride_ps, stride_pt,
                           stride_ss, SPLITS, BLOCK_R, ROWS, dt)
            x1 = (x1.to(tl.float32) + _expand(s, b_ptr, slot, R, col, col + HALF, stride_bs, stride_br, HALF,
                                              BLOCK_R, IEEE)).to(dt)
            x2 = (x2.to(tl.float32) + _expand(s, b_ptr, slot, R, col + HALF, col + 2 * HALF, stride_bs, stride_br,
                                              HALF, BLOCK_R, IEEE)).to(dt)
        if h < num_heads + num_kv_heads:
            cs = offs_t  # each token's row of cos/sin: its own, or with POS (tables over positions) its position's
            if POS:
                cs = tl.load(pos_ptr + offs_t, mask=rows, other=0).to(tl.int64)
            cp = cs[:, None] * stride_c + offs[None, :]
            sp = cs[:, None] * stride_s + offs[None, :]
            c1 = tl.load(cos_ptr + cp, mask=m, other=0.0).to(tl.float32)
            c2 = tl.load(cos_ptr + cp + HALF, mask=m, other=0.0).to(tl.float32)
            s1 = tl.load(sin_ptr + sp, mask=m, other=0.0).to(tl.float32)
            s2 = tl.load(sin_ptr + sp + HALF, mask=m, other=0.0).to(tl.float32)
            f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
            o1 = (_rnd(f1 * c1, dt) + _rnd(-f2 * s1, dt)).to(dt)
            o2 = (_rnd(f2 * c2, dt) + _rnd(f1 * s2, dt)).to(dt)
            if h < num_heads:
                tl.store(src, o1, mask=m)
                tl.store(src + HALF, o2, mask=m)
            else:
                _write_cache(k_ptr, kv_slot_ptr, offs_t, rows, h - num_heads, o1, o2, stride_kb, stride_ks, stride_kh,
                             PAGE, HALF)
        else:
            _write_cache(v_ptr, kv_slot_ptr, offs_t, rows, h - num_heads - num_kv_heads, x1, x2, stride_kb, stride_ks,
                         stride_kh, PAGE, HALF)


@triton.jit
def _write_cache(cache_ptr, kv_slot_ptr, offs_t, rows, head, lo, hi, stride_kb, stride_ks, stride_kh,
                 PAGE: tl.constexpr, HALF: tl.constexpr):
    """The rows' halves lo, hi of KV head `head` into the paged cache at each token's slot."""
    kv_slot = tl.load(kv_slot_ptr + offs_t, mask=rows, other=0).to(tl.int64)
    dst = cache_ptr + (kv_slot // PAGE) * stride_kb + (kv_slot % PAGE) * stride_ks + head * stride_kh
    offs = tl.arange(0, HALF)
    tl.store(dst[:, None] + offs[None, :], lo.to(cache_ptr.dtype.element_ty), mask=rows[:, None])
    tl.store(dst[:, None] + HALF + offs[None, :], hi.to(cache_ptr.dtype.element_ty), mask=rows[:, None])


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int, lora,
                  positions: torch.Tensor | None = None, *, settings: KernelSettings = _DEFAULTS) -> torch.Tensor:
    """triton_fused.rope_write_kv's contract with `lora` = (part [splits, T, 3R], B [S, R, qkv width], scale [S, 3],
    slots [T]): the q/k/v deltas added first, a group of tokens on one slot at a time; returns q [T, H, D]."""
    num_tokens, width = qkv.shape
    head_dim = width // (num_heads + 2 * num_kv_heads)
    if qkv.stride(1) != 1 or cos.stride(1) != 1 or sin.stride(1) != 1 or k_cache.stride(3) != 1:
        raise ValueError("rope_write_kv needs unit stride along the feature dimension")
    if head_dim & (head_dim - 1) or k_cache.stride() != v_cache.stride():
        raise ValueError("rope_write_kv needs a power-of-two head_dim and identically laid out K/V caches")
    part, b, scale, slots = lora
    rank = b.shape[1]
    if num_tokens:
        _rope_write_kv_kernel[(num_tokens, num_heads + 2 * num_kv_heads)](
            qkv, cos, sin, positions if positions is not None else slot_mapping, k_cache, v_cache, slot_mapping,
            num_tokens, num_heads, num_kv_heads, qkv.stride(0), cos.stride(0), sin.stride(0), k_cache.stride(0),
            k_cache.stride(1), k_cache.stride(2), part, b, scale, slots, rank, part.shape[0], b.shape[0] - 1,
            part.stride(0), part.stride(1), b.stride(0), b.stride(1), scale.stride(0),
            PAGE=k_cache.shape[1], HALF=head_dim // 2, ROWS=settings.group_rows, BLOCK_R=_rank_block(rank),
            SPLITS=triton.next_power_of_2(part.shape[0]), POS=positions is not None, IEEE=qkv.dtype == torch.float32,
            num_warps=settings.group_warps, **_launch(num_tokens, qkv.device))
    return qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, T, N, stride_g, stride_o,
                     part_ptr, b_ptr, scale_ptr, slots_ptr, a_ptr, dpart_ptr, R, num_splits, R2, skip_slot,
                     stride_ps, stride_pt, stride_bs, stride_br, stride_ss, stride_as, stride_ak, stride_ds,
                     stride_dt, BLOCK: tl.constexpr, SB: tl.constexpr, ROWS: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_R2: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    _wait_then_release(PDL)
    t = tl.program_id(0)
    nb = tl.program_id(1)
    slot, leader, first_rows, rows = _run_rows(slots_ptr, t, T, ROWS)
    if leader:
        offs_t = first_rows.to(tl.int64)
        dt = out_ptr.dtype.element_ty
        do_lora = slot != skip_slot
        offs_r2 = tl.arange(0, BLOCK_R2)
        dacc = tl.zeros([ROWS, BLOCK_R2], dtype=tl.float32)
        sg = tl.zeros([ROWS, BLOCK_R], dtype=tl.float32)
        su = tl.zeros([ROWS, BLOCK_R], dtype=tl.float32)
        if do_lora:
            sg = _lora_rows(part_ptr, scale_ptr, slot, offs_t, rows, 0, R, num_splits, stride_ps, stride_pt,
                            stride_ss, SPLITS, BLOCK_R, ROWS, dt)
            su = _lora_rows(part_ptr, scale_ptr, slot, offs_t, rows, 1, R, num_splits, stride_ps, stride_pt,
                            stride_ss, SPLITS, BLOCK_R, ROWS, dt)
        for c0 in range(0, BLOCK, SB):
            cols = nb * BLOCK + c0 + tl.arange(0, SB)
            mc = cols < N
            mask = rows[:, None] & mc[None, :]
            g = tl.load(gu_ptr + offs_t[:, None] * stride_g + cols[None, :], mask=mask, other=0.0)
            u = tl.load(gu_ptr + offs_t[:, None] * stride_g + N + cols[None, :], mask=mask, other=0.0)
            if do_lora:
                c = nb * BLOCK + c0
                g = (g.to(tl.float32) + _expand(sg, b_ptr, slot, R, c, N, stride_bs, stride_br, SB, BLOCK_R,
                                                IEEE)).to(dt)
                u = (u.to(tl.float32) + _expand(su, b_ptr, slot, R, N + c, 2 * N, stride_bs, stride_br, SB, BLOCK_R,
                                                IEEE)).to(dt)
            gf = g.to(tl.float32)
            act = (_rnd(gf / (1.0 + tl.exp(-gf)), dt) * u.to(tl.float32)).to(dt)
            tl.store(out_ptr + offs_t[:, None] * stride_o + cols[None, :], act, mask=mask)
            if do_lora:
                av = tl.load(a_ptr + slot * stride_as + cols[:, None] * stride_ak + offs_r2[None, :],
                             mask=mc[:, None] & (offs_r2[None, :] < R2), other=0.0)
                dacc += _dot(act, av, IEEE)
        if do_lora:
            tl.store(dpart_ptr + nb * stride_ds + offs_t[:, None] * stride_dt + offs_r2[None, :], dacc,
                     mask=rows[:, None] & (offs_r2[None, :] < R2))


def silu_mul(gate_up: torch.Tensor, lora, *,
             settings: KernelSettings = _DEFAULTS) -> tuple[torch.Tensor, torch.Tensor]:
    """triton_fused.silu_mul's contract with `lora` = (part [splits, T, 2R], B_gate_up [S, R, 2N], scale [S, 2],
    A_down [S, N, R2], slots [T]) -> (act [T, N], down-shrink partials [blocks, T, R2] for lora_expand)."""
    num_tokens, width = gate_up.shape
    n = width // 2
    if gate_up.stride(1) != 1:
        raise ValueError("silu_mul needs unit stride along the feature dimension")
    part, b, scale, a_down, slots = lora
    rank, r2 = b.shape[1], a_down.shape[2]
    block_r, block_r2 = _rank_block(rank), _rank_block(r2)
    block = min(settings.silu_lora_block, triton.next_power_of_2(n))
    nblocks = triton.cdiv(n, block)
    sb = min(block, settings.group_sb or max(16, 2048 // max(block_r, block_r2)))
    out = torch.empty(num_tokens, n, dtype=gate_up.dtype, device=gate_up.device)
    dpart = torch.empty(nblocks, num_tokens, r2, dtype=torch.float32, device=gate_up.device)
    if num_tokens:
        _silu_mul_kernel[(num_tokens, nblocks)](
            gate_up, out, num_tokens, n, gate_up.stride(0), out.stride(0), part, b, scale, slots, a_down, dpart, rank,
            part.shape[0], r2, b.shape[0] - 1, part.stride(0), part.stride(1), b.stride(0), b.stride(1),
            scale.stride(0), a_down.stride(0), a_down.stride(1), dpart.stride(0), dpart.stride(1),
            BLOCK=block, SB=sb, ROWS=settings.group_rows, BLOCK_R=block_r, BLOCK_R2=block_r2,
            SPLITS=triton.next_power_of_2(part.shape[0]), IEEE=gate_up.dtype == torch.float32,
            num_warps=settings.group_warps, **_launch(num_tokens, gate_up.device))
    return out, dpart
