"""triton_fused.py's LoRA-folding kernels over runs of a sequence's tokens (the k+1 tokens of a verify pass, a prompt's
tokens in a graph-sized pass): a program takes up to ROWS consecutive tokens of one sequence on one adapter slot,
loads each adapter tile it needs once into registers, and runs the per-token kernel's math for each of its tokens in
turn (an unrolled loop, every load and store masked to the run), so a verify pass reads each sequence's adapter
weights once, as a decode step does, where the per-token kernels read them k+1 times.

    add_rms_norm:  x = x + delta (+ extra), h = w * rms_norm(x), part[s, t] = h[t, chunk s] @ A[slot, chunk s]
    rope_write_kv: qkv[t] += part[:, t] summed @ B[slot] * scale[slot]; rotary on q and k; k and v into the cache
    silu_mul:      gate_up[t] += part[:, t] summed @ B[slot] * scale[slot]; act = silu(gate) * up;
                   part_down[c, t] = act[t, block c] @ A_down[slot, block c]

Runs come from the device (`_run`): a token leads one when it is its sequence's first (query index 0), starts another
ROWS of it, or changes slot; grids are sized by tokens, programs of other tokens return at once, so a CUDA graph
captured once serves any mix. Contracts, rounding and partial-sum layouts are the per-token kernels' (a consumer of
either producer's partials works); each token's arithmetic is the per-token kernel's, in the same order where the
tiles are the same (the norm's shrink, rotary), the down shrink summed over narrower column steps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch as _launch
from .pdl import wait_then_release as _wait_then_release
from .rounding import rnd as _rnd
from .settings import KernelSettings
from .folding import lora_row as _lora_row
from .folding import rank_block as _rank_block

_DEFAULTS = KernelSettings()


@triton.jit
def _leads(slots_ptr, qidx_ptr, offs, T, ROWS: tl.constexpr):
    """Whether each token of `offs` leads a run: its sequence's first token, the first of another ROWS of it, or on
    another slot than the token before it."""
    inside = offs < T
    slot = tl.load(slots_ptr + offs, mask=inside, other=-1)
    prev = tl.load(slots_ptr + offs - 1, mask=inside & (offs > 0), other=-2)
    q = tl.load(qidx_ptr + offs, mask=inside, other=0)
    return inside & ((q % ROWS == 0) | (slot != prev))


@triton.jit
def _run(slots_ptr, qidx_ptr, t, T, ROWS: tl.constexpr):
    """(leader?, slot, run length n): token t's run is tokens t .. t + n - 1, up to the next leader or the end
    (1 <= n <= ROWS)."""
    offs = t + tl.arange(0, ROWS)
    leads = _leads(slots_ptr, qidx_ptr, offs, T, ROWS)
    stop = (offs > t) & (leads | (offs >= T))
    n = tl.sum((tl.cumsum(stop.to(tl.int32), axis=0) == 0).to(tl.int32), axis=0)
    leader = tl.sum(tl.where(offs == t, leads.to(tl.int32), 0), axis=0) > 0
    slot = tl.load(slots_ptr + t).to(tl.int64)
    return leader, slot, n


@triton.jit
def _add_rms_norm_kernel(x_ptr, d_ptr, e_ptr, w_ptr, res_ptr, out_ptr, a_ptr, slots_ptr, qidx_ptr, part_ptr, T, N, RT,
                         eps, skip_slot, stride_x, stride_d, stride_e, stride_r, stride_o, stride_as, stride_ak,
                         stride_ps, stride_pt, HAS_DELTA: tl.constexpr, HAS_EXTRA: tl.constexpr, BLOCK: tl.constexpr,
                         CHUNK: tl.constexpr, BLOCK_R: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr):
    _wait_then_release(PDL)
    t = tl.program_id(0)
    split = tl.program_id(1)
    leader, slot, n = _run(slots_ptr, qidx_ptr, t, T, ROWS)
    if leader:
        dt = out_ptr.dtype.element_ty
        offs = tl.arange(0, BLOCK)
        cols = split * CHUNK + tl.arange(0, CHUNK)
        mc = cols < N
        offs_r = tl.arange(0, BLOCK_R)
        do_lora = slot != skip_slot
        # the run's adapter tile, once for all of its tokens
        av = tl.load(a_ptr + slot * stride_as + cols[:, None] * stride_ak + offs_r[None, :],
                     mask=mc[:, None] & (offs_r[None, :] < RT) & do_lora, other=0.0).to(tl.float32)
        wc = tl.load(w_ptr + cols, mask=mc, other=0.0).to(tl.float32)
        for i in tl.static_range(ROWS):
            live = i < n
            row = (t + i).to(tl.int64)
            m = (offs < N) & live
            x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0)
            xc = tl.load(x_ptr + row * stride_x + cols, mask=mc & live, other=0.0)
            if HAS_DELTA:
                d = tl.load(d_ptr + row * stride_d + offs, mask=m, other=0.0).to(tl.float32)
                dc = tl.load(d_ptr + row * stride_d + cols, mask=mc & live, other=0.0).to(tl.float32)
                if HAS_EXTRA:
                    d = _rnd(d + tl.load(e_ptr + row * stride_e + offs, mask=m, other=0.0), dt)
                    dc = _rnd(dc + tl.load(e_ptr + row * stride_e + cols, mask=mc & live, other=0.0), dt)
                x = _rnd(x.to(tl.float32) + d, dt)
                xc = (xc.to(tl.float32) + dc).to(dt)
                tl.store(res_ptr + row * stride_r + cols, xc, mask=mc & live)
            xf = x.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
            h = (wc * _rnd(xc.to(tl.float32) * rstd, dt)).to(dt)
            tl.store(out_ptr + row * stride_o + cols, h, mask=mc & live)
            if do_lora:
                acc = tl.sum(h.to(tl.float32)[:, None] * av, axis=0)
                tl.store(part_ptr + split * stride_ps + row * stride_pt + offs_r, acc, mask=(offs_r < RT) & live)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, lora,
                 extra: torch.Tensor | None = None, *,
                 settings: KernelSettings = _DEFAULTS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """triton_fused.add_rms_norm's contract with `lora` = (A [S, N, RT], slots [T], qidx [T]): each token's query
    index in its sequence, which delimits the runs."""
    a, slots, qidx = lora
    num_tokens, n = x.shape
    if extra is not None and (delta is None or extra.shape != x.shape or extra.dtype != torch.float32
                              or extra.stride(1) != 1):
        raise ValueError(f"add_rms_norm: extra must be float32 {tuple(x.shape)} beside a delta")
    rt = a.shape[2]
    chunk = settings.norm_chunk
    splits = triton.cdiv(n, chunk)
    out = x.new_empty(num_tokens, n)
    res = torch.empty_like(x) if delta is not None else x
    part = torch.empty(splits, num_tokens, rt, dtype=torch.float32, device=x.device)
    if num_tokens:
        _add_rms_norm_kernel[(num_tokens, splits)](
            x, delta if delta is not None else x, extra if extra is not None else x, weight, res, out, a, slots, qidx,
            part, num_tokens, n, rt, eps, a.shape[0] - 1, x.stride(0), delta.stride(0) if delta is not None else 0,
            extra.stride(0) if extra is not None else 0, res.stride(0), out.stride(0), a.stride(0), a.stride(1),
            part.stride(0), part.stride(1), HAS_DELTA=delta is not None, HAS_EXTRA=extra is not None,
            BLOCK=triton.next_power_of_2(n), CHUNK=chunk, BLOCK_R=_rank_block(rt), ROWS=settings.lora_run_rows,
            num_warps=settings.run_warps, **_launch(num_tokens, x.device, settings.pdl_max_tokens))
    return res, out, part


@triton.jit
def _rope_write_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, k_ptr, v_ptr, kv_slot_ptr, T, num_heads, num_kv_heads,
                          stride_t, stride_c, stride_s, stride_kb, stride_ks, stride_kh,
                          part_ptr, b_ptr, scale_ptr, slots_ptr, qidx_ptr, R, num_splits, skip_slot,
                          stride_ps, stride_pt, stride_bs, stride_br, stride_ss,
                          PAGE: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr, SPLITS: tl.constexpr,
                          POS: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr):
    _wait_then_release(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    leader, slot, n = _run(slots_ptr, qidx_ptr, t, T, ROWS)
    if leader:
        dt = qkv_ptr.dtype.element_ty
        offs = tl.arange(0, HALF)
        offs_r = tl.arange(0, BLOCK_R)
        do_lora = slot != skip_slot
        seg = (h >= num_heads).to(tl.int32) + (h >= num_heads + num_kv_heads).to(tl.int32)
        col = h * (2 * HALF)
        # the head's columns of the run's B, once for all of its tokens
        bmask = (offs_r[:, None] < R) & do_lora
        b_lo = tl.load(b_ptr + slot * stride_bs + offs_r[:, None] * stride_br + col + offs[None, :], mask=bmask,
                       other=0.0).to(tl.float32)
        b_hi = tl.load(b_ptr + slot * stride_bs + offs_r[:, None] * stride_br + col + HALF + offs[None, :],
                       mask=bmask, other=0.0).to(tl.float32)
        for i in tl.static_range(ROWS):
            live = i < n
            row = (t + i).to(tl.int64)
            src = qkv_ptr + row * stride_t + col
            x1 = tl.load(src + offs, mask=(offs < HALF) & live, other=0.0)
            x2 = tl.load(src + HALF + offs, mask=(offs < HALF) & live, other=0.0)
            if do_lora:
                s = _lora_row(part_ptr, scale_ptr, slot, row, seg, R, num_splits * live, stride_ps, stride_pt,
                              stride_ss, SPLITS, BLOCK_R, dt)
                x1 = (x1.to(tl.float32) + tl.sum(s[:, None] * b_lo, axis=0)).to(dt)
                x2 = (x2.to(tl.float32) + tl.sum(s[:, None] * b_hi, axis=0)).to(dt)
            if h < num_heads + num_kv_heads:
                cs = row
                if POS:
                    cs = tl.load(pos_ptr + row, mask=live, other=0).to(tl.int64)
                mh = (offs < HALF) & live
                c1 = tl.load(cos_ptr + cs * stride_c + offs, mask=mh, other=0.0).to(tl.float32)
                c2 = tl.load(cos_ptr + cs * stride_c + HALF + offs, mask=mh, other=0.0).to(tl.float32)
                s1 = tl.load(sin_ptr + cs * stride_s + offs, mask=mh, other=0.0).to(tl.float32)
                s2 = tl.load(sin_ptr + cs * stride_s + HALF + offs, mask=mh, other=0.0).to(tl.float32)
                f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
                o1 = (_rnd(f1 * c1, dt) + _rnd(-f2 * s1, dt)).to(dt)
                o2 = (_rnd(f2 * c2, dt) + _rnd(f1 * s2, dt)).to(dt)
                if h < num_heads:
                    tl.store(src + offs, o1, mask=(offs < HALF) & live)
                    tl.store(src + HALF + offs, o2, mask=(offs < HALF) & live)
                else:
                    _write_cache(k_ptr, kv_slot_ptr, row, live, h - num_heads, o1, o2, stride_kb, stride_ks,
                                 stride_kh, PAGE, HALF)
            else:
                _write_cache(v_ptr, kv_slot_ptr, row, live, h - num_heads - num_kv_heads, x1, x2, stride_kb,
                             stride_ks, stride_kh, PAGE, HALF)


@triton.jit
def _write_cache(cache_ptr, kv_slot_ptr, row, live, head, lo, hi, stride_kb, stride_ks, stride_kh,
                 PAGE: tl.constexpr, HALF: tl.constexpr):
    """A token's halves lo, hi of KV head `head` into the paged cache at its slot (nothing unless `live`)."""
    kv_slot = tl.load(kv_slot_ptr + row, mask=live, other=0).to(tl.int64)
    dst = cache_ptr + (kv_slot // PAGE) * stride_kb + (kv_slot % PAGE) * stride_ks + head * stride_kh
    offs = tl.arange(0, HALF)
    tl.store(dst + offs, lo.to(cache_ptr.dtype.element_ty), mask=(offs < HALF) & live)
    tl.store(dst + HALF + offs, hi.to(cache_ptr.dtype.element_ty), mask=(offs < HALF) & live)


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int, lora,
                  positions: torch.Tensor | None = None, *, settings: KernelSettings = _DEFAULTS) -> torch.Tensor:
    """triton_fused.rope_write_kv's contract with `lora` = (part [splits, T, 3R], B [S, R, qkv width], scale [S, 3],
    slots [T], qidx [T])."""
    num_tokens, width = qkv.shape
    head_dim = width // (num_heads + 2 * num_kv_heads)
    if qkv.stride(1) != 1 or cos.stride(1) != 1 or sin.stride(1) != 1 or k_cache.stride(3) != 1:
        raise ValueError("rope_write_kv needs unit stride along the feature dimension")
    if head_dim & (head_dim - 1) or k_cache.stride() != v_cache.stride():
        raise ValueError("rope_write_kv needs a power-of-two head_dim and identically laid out K/V caches")
    part, b, scale, slots, qidx = lora
    rank = b.shape[1]
    if num_tokens:
        _rope_write_kv_kernel[(num_tokens, num_heads + 2 * num_kv_heads)](
            qkv, cos, sin, positions if positions is not None else slot_mapping, k_cache, v_cache, slot_mapping,
            num_tokens, num_heads, num_kv_heads, qkv.stride(0), cos.stride(0), sin.stride(0), k_cache.stride(0),
            k_cache.stride(1), k_cache.stride(2), part, b, scale, slots, qidx, rank, part.shape[0], b.shape[0] - 1,
            part.stride(0), part.stride(1), b.stride(0), b.stride(1), scale.stride(0),
            PAGE=k_cache.shape[1], HALF=head_dim // 2, BLOCK_R=_rank_block(rank),
            SPLITS=triton.next_power_of_2(part.shape[0]), POS=positions is not None, ROWS=settings.lora_run_rows,
            num_warps=settings.rope_lora_warps, **_launch(num_tokens, qkv.device, settings.pdl_max_tokens))
    return qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, T, N, stride_g, stride_o,
                     part_ptr, b_ptr, scale_ptr, slots_ptr, qidx_ptr, a_ptr, dpart_ptr, R, num_splits, R2, skip_slot,
                     stride_ps, stride_pt, stride_bs, stride_br, stride_ss, stride_as, stride_ak, stride_ds,
                     stride_dt, BLOCK: tl.constexpr, SB: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_R2: tl.constexpr, SPLITS: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr):
    _wait_then_release(PDL)
    t = tl.program_id(0)
    nb = tl.program_id(1)
    leader, slot, n = _run(slots_ptr, qidx_ptr, t, T, ROWS)
    if leader:
        dt = out_ptr.dtype.element_ty
        do_lora = slot != skip_slot
        offs_r = tl.arange(0, BLOCK_R)
        offs_r2 = tl.arange(0, BLOCK_R2)
        lane = tl.arange(0, ROWS)
        # each token's gate and up rank-space inputs, [ROWS, BLOCK_R] (rows past the run zero)
        sg = tl.zeros([ROWS, BLOCK_R], dtype=tl.float32)
        su = tl.zeros([ROWS, BLOCK_R], dtype=tl.float32)
        if do_lora:
            for i in tl.static_range(ROWS):
                live = i < n
                row = (t + i).to(tl.int64)
                g_i = _lora_row(part_ptr, scale_ptr, slot, row, 0, R, num_splits * live, stride_ps, stride_pt,
                                stride_ss, SPLITS, BLOCK_R, dt)
                u_i = _lora_row(part_ptr, scale_ptr, slot, row, 1, R, num_splits * live, stride_ps, stride_pt,
                                stride_ss, SPLITS, BLOCK_R, dt)
                sg += tl.where(lane[:, None] == i, g_i[None, :], 0.0)
                su += tl.where(lane[:, None] == i, u_i[None, :], 0.0)
        dacc = tl.zeros([ROWS, BLOCK_R2], dtype=tl.float32)
        for c0 in range(0, BLOCK, SB):
            cols = nb * BLOCK + c0 + tl.arange(0, SB)
            m = cols < N
            # the run's B (gate and up columns) and A_down tiles, once for all of its tokens
            bmask = (offs_r[:, None] < R) & m[None, :] & do_lora
            bg = tl.load(b_ptr + slot * stride_bs + offs_r[:, None] * stride_br + cols[None, :], mask=bmask,
                         other=0.0).to(tl.float32)
            bu = tl.load(b_ptr + slot * stride_bs + offs_r[:, None] * stride_br + N + cols[None, :], mask=bmask,
                         other=0.0).to(tl.float32)
            av = tl.load(a_ptr + slot * stride_as + cols[:, None] * stride_ak + offs_r2[None, :],
                         mask=m[:, None] & (offs_r2[None, :] < R2) & do_lora, other=0.0).to(tl.float32)
            for i in tl.static_range(ROWS):
                live = i < n
                row = (t + i).to(tl.int64)
                g = tl.load(gu_ptr + row * stride_g + cols, mask=m & live, other=0.0)
                u = tl.load(gu_ptr + row * stride_g + N + cols, mask=m & live, other=0.0)
                if do_lora:
                    sg_i = tl.sum(tl.where(lane[:, None] == i, sg, 0.0), axis=0)
                    su_i = tl.sum(tl.where(lane[:, None] == i, su, 0.0), axis=0)
                    g = (g.to(tl.float32) + tl.sum(sg_i[:, None] * bg, axis=0)).to(dt)
                    u = (u.to(tl.float32) + tl.sum(su_i[:, None] * bu, axis=0)).to(dt)
                gf = g.to(tl.float32)
                act = (_rnd(gf / (1.0 + tl.exp(-gf)), dt) * u.to(tl.float32)).to(dt)
                tl.store(out_ptr + row * stride_o + cols, act, mask=m & live)
                if do_lora:
                    d_i = tl.sum(act.to(tl.float32)[:, None] * av, axis=0)
                    dacc += tl.where(lane[:, None] == i, d_i[None, :], 0.0)
        if do_lora:
            offs_t = t + lane
            tl.store(dpart_ptr + nb * stride_ds + offs_t[:, None].to(tl.int64) * stride_dt + offs_r2[None, :], dacc,
                     mask=(lane[:, None] < n) & (offs_r2[None, :] < R2))


def silu_mul(gate_up: torch.Tensor, lora, *,
             settings: KernelSettings = _DEFAULTS) -> tuple[torch.Tensor, torch.Tensor]:
    """triton_fused.silu_mul's contract with `lora` = (part [splits, T, 2R], B_gate_up [S, R, 2N], scale [S, 2],
    A_down [S, N, R2], slots [T], qidx [T])."""
    num_tokens, width = gate_up.shape
    n = width // 2
    if gate_up.stride(1) != 1:
        raise ValueError("silu_mul needs unit stride along the feature dimension")
    part, b, scale, a_down, slots, qidx = lora
    rank, r2 = b.shape[1], a_down.shape[2]
    block_r, block_r2 = _rank_block(rank), _rank_block(r2)
    block = min(settings.silu_lora_block, triton.next_power_of_2(n))
    nblocks = triton.cdiv(n, block)
    sb = min(block, settings.run_silu_sb or max(16, 2048 // max(block_r, block_r2)))
    out = torch.empty(num_tokens, n, dtype=gate_up.dtype, device=gate_up.device)
    dpart = torch.empty(nblocks, num_tokens, r2, dtype=torch.float32, device=gate_up.device)
    if num_tokens:
        _silu_mul_kernel[(num_tokens, nblocks)](
            gate_up, out, num_tokens, n, gate_up.stride(0), out.stride(0), part, b, scale, slots, qidx, a_down, dpart,
            rank, part.shape[0], r2, b.shape[0] - 1, part.stride(0), part.stride(1), b.stride(0), b.stride(1),
            scale.stride(0), a_down.stride(0), a_down.stride(1), dpart.stride(0), dpart.stride(1),
            BLOCK=block, SB=sb, BLOCK_R=block_r, BLOCK_R2=block_r2, SPLITS=triton.next_power_of_2(part.shape[0]),
            ROWS=settings.lora_run_rows, num_warps=settings.run_warps,
            **_launch(num_tokens, gate_up.device, settings.pdl_max_tokens))
    return out, dpart
