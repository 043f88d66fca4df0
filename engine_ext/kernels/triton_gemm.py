"""Skinny matrix products for decode in Triton: y = x @ W^T (+ bias) for a few rows of x (the tokens of a
decode step) against a large weight W [N, K], as F.linear computes it (fp32 accumulation, one rounding).

Why: at decode the products read every weight once for a handful of rows, so they are bound by memory
bandwidth, and the library's kernels for these shapes leave most of the chip idle. Measured on the H200
(bench/results/2026-11-29-h200-run8-profile.log, 1B shape, batch 32): the q/k/v and o products (12.6 and
8.4 MB of weights per layer) ran at about 1.7 TB/s with 48 and 32 thread blocks. Here every product gets
enough blocks to fill the chip: the output columns are tiled (BLOCK_N) and, when that gives too few tiles,
K is split too (SPLIT_K). Split partials are reduced without a second launch and deterministically: each
split stores its fp32 partial in a workspace and takes a ticket from its tile's counter; the last one sums
the partials in split order, writes y and resets the counter (so a CUDA graph replays it as captured).
The counters are one buffer per device: products on two streams at once must not share it (the engine runs
its forwards on one stream).

With `lora`, the epilogue also adds a LoRA group's expand from the shrink partials a fused kernel left (the
attention kernel for o, the SiLU kernel for down, the norm kernels for q/k/v and gate/up): each output tile
reads its rows' B tiles for the module that owns its columns, which removes the expand launches (o, down)
and the expand work of the rotary and SiLU kernels (q/k/v, gate/up) from a decode layer.

Off unless LORASERVE_SKINNY_GEMM=1 (not yet measured against the library on a GPU; bench/gemm_sweep.py
does that). Used for forwards of at most MAX_ROWS tokens; larger ones call F.linear.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .rounding import rnd

ENABLED = os.environ.get("LORASERVE_SKINNY_GEMM", "0") == "1"
MAX_ROWS = int(os.environ.get("LORASERVE_SKINNY_MAX_ROWS", "32"))
# Launch settings (bench/gemm_sweep.py sweeps them): column tile, K step, warps, pipeline stages, and the number
# of thread blocks to aim for (K is split until the tiles reach it; 0: never split).
BLOCK_N = int(os.environ.get("LORASERVE_SKINNY_BLOCK_N", "64"))
BLOCK_K = int(os.environ.get("LORASERVE_SKINNY_BLOCK_K", "128"))
NUM_WARPS = int(os.environ.get("LORASERVE_SKINNY_WARPS", "4"))
NUM_STAGES = int(os.environ.get("LORASERVE_SKINNY_STAGES", "4"))
TARGET_BLOCKS = int(os.environ.get("LORASERVE_SKINNY_TARGET_BLOCKS", "264"))  # two per SM on the H200
_MAX_TILES = 1 << 14
_SMEM_BUDGET = 160 << 10  # bytes (H200: 227 KB of shared memory per block)
_LORA_TILE = 8192  # fp32 elements of the LoRA epilogue's [rows, ranks, columns] product a step (64 registers a thread)
_counters: dict[torch.device, torch.Tensor] = {}


@triton.jit
def _lora_epilogue(y, offs_m, offs_n, mm, mn, seg, part_ptr, b_ptr, scale_ptr, slots_ptr, R, num_parts, skip_slot,
                   stride_ps, stride_pt, stride_bs, stride_br, stride_ss, DT: tl.constexpr, BLOCK_R: tl.constexpr,
                   R_CHUNK: tl.constexpr, PARTS: tl.constexpr):
    """y (fp32 [BLOCK_M, BLOCK_N], already rounded to DT) plus each row's LoRA expand, as lora_expand adds it:
    s = (sum over parts of part[:, m, seg*R:(seg+1)*R]) * scale[slot(m), seg] rounded to DT, delta = s @
    B[slot(m), :, cols], for the group's module `seg` that owns this column tile. Every row has its own slot,
    so the product is a batched mat-vec over R_CHUNK ranks at a time."""
    slot = tl.load(slots_ptr + offs_m, mask=mm, other=skip_slot).to(tl.int64)
    live = mm & (slot != skip_slot)
    sc = tl.load(scale_ptr + slot * stride_ss + seg, mask=live, other=0.0).to(tl.float32)
    offs_p = tl.arange(0, PARTS)
    delta = tl.zeros_like(y)
    for r0 in tl.static_range(0, BLOCK_R, R_CHUNK):
        offs_r = r0 + tl.arange(0, R_CHUNK)
        mr = offs_r < R
        parts = tl.load(part_ptr + offs_p[:, None, None] * stride_ps + offs_m[None, :, None].to(tl.int64) * stride_pt
                        + seg * R + offs_r[None, None, :],
                        mask=(offs_p[:, None, None] < num_parts) & live[None, :, None] & mr[None, None, :], other=0.0)
        s = rnd(tl.sum(parts, axis=0) * sc[:, None], DT)  # [BLOCK_M, R_CHUNK]
        b = tl.load(b_ptr + slot[:, None, None] * stride_bs + offs_r[None, :, None] * stride_br + offs_n[None, None, :],
                    mask=live[:, None, None] & mr[None, :, None] & mn[None, None, :], other=0.0)
        delta += tl.sum(s[:, :, None] * b.to(tl.float32), axis=1)
    return y + delta


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, k_per_split, stride_xm, stride_wn,
                   stride_ym, part_ptr, b_ptr, scale_ptr, slots_ptr, R, num_parts, skip_slot, stride_ps, stride_pt,
                   stride_bs, stride_br, stride_ss, SEG1, SEG2, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                   LORA: tl.constexpr, BLOCK_R: tl.constexpr, R_CHUNK: tl.constexpr, PARTS: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mm = offs_m < M
    mn = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k0 = pid_k * k_per_split
    for kk in range(0, k_per_split, BLOCK_K):
        offs_k = k0 + kk + tl.arange(0, BLOCK_K)
        mk = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=mm[:, None] & mk[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                    mask=mn[:, None] & mk[None, :], other=0.0)
        if IEEE:  # float32 weights: full-precision products, not tf32
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    mask = mm[:, None] & mn[None, :]
    dt = y_ptr.dtype.element_ty
    seg = (pid_n * BLOCK_N >= SEG1).to(tl.int32) + (pid_n * BLOCK_N >= SEG2).to(tl.int32)  # the tile's module
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mn, other=0.0).to(tl.float32)[None, :]
        if LORA:  # the base product rounded as F.linear rounds it, then the LoRA delta (rounded once more)
            acc = _lora_epilogue(rnd(acc, dt), offs_m, offs_n, mm, mn, seg, part_ptr, b_ptr, scale_ptr, slots_ptr, R,
                                 num_parts, skip_slot, stride_ps, stride_pt, stride_bs, stride_br, stride_ss, dt,
                                 BLOCK_R, R_CHUNK, PARTS)
        tl.store(y_ptrs, acc.to(dt), mask=mask)
    else:
        # this split's partial, then a ticket; the last split of the tile reduces in split order
        ws_tile = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(ws_ptr + pid_k.to(tl.int64) * M * N + ws_tile, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the ticket (release) is taken
        tile = pid_m * tl.num_programs(0) + pid_n
        ticket = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if ticket == SPLIT_K - 1:
            tl.debug_barrier()
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(ws_ptr + s * M * N + ws_tile, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(bias_ptr + offs_n, mask=mn, other=0.0).to(tl.float32)[None, :]
            if LORA:
                total = _lora_epilogue(rnd(total, dt), offs_m, offs_n, mm, mn, seg, part_ptr, b_ptr, scale_ptr,
                                       slots_ptr, R, num_parts, skip_slot, stride_ps, stride_pt, stride_bs, stride_br,
                                       stride_ss, dt, BLOCK_R, R_CHUNK, PARTS)
            tl.store(y_ptrs, total.to(dt), mask=mask)
            tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next product (and the next graph replay)


# Settings per weight shape (N, K) -> (BLOCK_N, BLOCK_K, stages, target blocks), from bench/gemm_sweep.py;
# shapes not listed take the module defaults above.
TUNED: dict[tuple[int, int], tuple[int, int, int, int]] = {}


def _settings(n: int, k: int) -> tuple[int, int, int, int]:
    return TUNED.get((n, k), (BLOCK_N, BLOCK_K, NUM_STAGES, TARGET_BLOCKS))


def plan(m: int, n: int, k: int, align: int = 0) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K) for an [m, k] @ [k, n] product; `align`: column tiles must divide it
    (a fused group's module boundaries), 0: no constraint."""
    want_n, want_k, _, target = _settings(n, k)
    block_m = max(16, triton.next_power_of_2(m))
    block_n = min(want_n, max(16, triton.next_power_of_2(n)), align or want_n)
    block_k = min(want_k, max(16, triton.next_power_of_2(k)))
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split = 1
    if target:
        while split * 2 * tiles <= target and k // (split * 2) >= 2 * block_k:
            split *= 2
    return block_m, block_n, block_k, split


def _align(lora) -> int:
    """The largest power of two dividing every module start of a fused group's output (0: one module)."""
    segments = lora[4] if lora is not None and len(lora) > 4 else (0,)
    return min((start & -start for start in segments[1:]), default=0)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, lora=None) -> torch.Tensor:
    """F.linear(x, weight, bias) (+ a LoRA expand, see skinny_matmul); through the Triton kernel when enabled
    and x has at most MAX_ROWS rows, else F.linear and triton_lora.lora_expand."""
    align = _align(lora)
    if not (ENABLED and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.is_cuda and (not align or align >= 16)):
        y = F.linear(x, weight, bias)
        if lora is not None:
            from .triton_lora import lora_expand

            part, b, scale, slots = lora[:4]
            lora_expand(y, part, b, scale, slots, b.shape[0] - 1, *lora[4:])
        return y
    return skinny_matmul(x, weight, bias, lora)


def skinny_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, lora=None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias [N]) -> [M, N] in x's dtype, always through the Triton kernel.

    `lora`: (part [P, M, nseg*R] float32 shrink partials, B [S, R, N], scale [S] or [S, nseg], slots [M] long,
    optionally the start column of each module of a fused group, 0 first): the group's LoRA expand added in the
    epilogue, as triton_lora.lora_expand adds it after the product (slot S - 1 skips). Column tiles never
    straddle two modules."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or x.dtype != weight.dtype or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"skinny_matmul: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}, "
                         f"bias {None if bias is None else tuple(bias.shape)} do not fit")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("skinny_matmul needs unit stride along K")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    align = _align(lora)
    if align and align < 16:
        raise ValueError(f"skinny_matmul: module starts {lora[4]} leave no 16-column tile (use skinny_linear)")
    block_m, block_n, block_k, split = plan(m, n, k, align)
    stages = _settings(n, k)[2]  # the x and W tiles of every pipeline stage fit the shared-memory budget
    while stages > 1 and stages * (block_m + block_n) * block_k * x.element_size() > _SMEM_BUDGET:
        stages -= 1
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    grid = (triton.cdiv(n, block_n), split, triton.cdiv(m, block_m))
    if split > 1:
        if grid[0] * grid[2] > _MAX_TILES:
            raise ValueError(f"skinny_matmul: {grid[0] * grid[2]} tiles exceed the counter buffer ({_MAX_TILES})")
        ws = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        counters = _counters.get(x.device)
        if counters is None:
            counters = _counters[x.device] = torch.zeros(_MAX_TILES, dtype=torch.int32, device=x.device)
    else:
        ws = counters = y
    if lora is None:  # placeholders (LORA=False never reads them)
        lora_args, block_r, r_chunk, parts = (y, y, y, y, 0, 0, 0, 0, 0, 0, 0, 0, n, n), 1, 1, 1
    else:
        part, b, scale, slots = lora[:4]
        segments = tuple(lora[4]) if len(lora) > 4 else (0,)
        rank = b.shape[1]
        if (part.shape[1:] != (m, len(segments) * rank) or b.shape[2] != n or slots.shape != (m,)
                or b.stride(2) != 1 or part.stride(2) != 1 or len(segments) > 3):
            raise ValueError(f"skinny_matmul: LoRA partials {tuple(part.shape)}, B {tuple(b.shape)} and slots "
                             f"{tuple(slots.shape)} do not fit a [{m}, {n}] product")
        starts = list(segments[1:]) + [n] * (3 - len(segments))
        lora_args = (part, b, scale, slots, rank, part.shape[0], b.shape[0] - 1, part.stride(0), part.stride(1),
                     b.stride(0), b.stride(1), scale.stride(0), starts[0], starts[1])
        block_r = triton.next_power_of_2(rank)
        r_chunk = max(1, min(block_r, _LORA_TILE // (block_m * block_n)))  # [BLOCK_M, chunk, BLOCK_N] fp32 product
        parts = triton.next_power_of_2(part.shape[0])
    _skinny_kernel[grid](x, weight, bias if bias is not None else y, y, ws, counters, m, n, k, k_per_split,
                         x.stride(0), weight.stride(0), y.stride(0), *lora_args, BLOCK_M=block_m, BLOCK_N=block_n,
                         BLOCK_K=block_k, SPLIT_K=split, HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
                         LORA=lora is not None, BLOCK_R=block_r, R_CHUNK=r_chunk, PARTS=parts,
                         num_warps=NUM_WARPS, num_stages=stages)
    return y
