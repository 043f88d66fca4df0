"""Batched multi-LoRA in Triton: a shrink and an expand kernel over runs of tokens sharing an adapter.

    y[i] += (x[i] @ A[slot[i]]) @ B[slot[i]] * scale[slot[i]]      (same contract as lora_ops.py)

Runs are found on the device: a token leads a run when its slot differs from the previous
token's (or it starts an aligned block of 16); the leader's program multiplies the run's rows as
one tensor-core tile, so the k+1 tokens of a verify pass (and neighbours sharing an adapter) read
each A/B tile once. Nothing about the adapter mix reaches the host, so a CUDA graph captured once
serves any mix (the slot vector is a graph input); grids are sized by tokens, and programs of
non-leaders return at once. Ranks below the slot stack's R are zero-padded (exact). Tokens on
the zero slot (base-only) skip all work.

shrink: grid (T, splits); the leader of run r at split s sums x[r, k] @ A[slot, k, :] over its K
        range into part[s, r, :] (fp32). Splitting K keeps the chip busy at small batches without atomics.
expand: grid (T, cdiv(out, BLOCK_N)); the leader sums the K partials, scales, multiplies by its B
        tile and adds into y (any row stride: y may be a column slice of a fused output), or (`lora_delta`)
        stores the fp32 delta itself into a buffer of its own, zero on the zero slot, for a consumer that
        adds it (the fused model adds o's and down's in the next norm kernel, so these launches run on a
        side stream beside the o and down products).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .settings import KernelSettings

_BLOCK_T = 16  # tokens of one run handled together (the smallest tensor-core tile)
_DEFAULTS = KernelSettings()


@triton.jit
def _run_rows(slots_ptr, t, T, BLOCK_T: tl.constexpr):
    """(slot, leader?, run tokens t + arange(BLOCK_T), mask of the run): tokens t.. that share t's slot.

    A token leads when it starts a run of equal slots or an aligned block of BLOCK_T tokens; its
    run ends at the first other slot or the next block boundary, so every token has one leader."""
    slot = tl.load(slots_ptr + t).to(tl.int64)
    prev = tl.load(slots_ptr + t - 1, mask=t > 0, other=-1).to(tl.int64)
    leader = (slot != prev) | (t % BLOCK_T == 0)
    offs_t = t + tl.arange(0, BLOCK_T)
    in_block = (offs_t < T) & (offs_t < (t // BLOCK_T + 1) * BLOCK_T)
    run_slots = tl.load(slots_ptr + offs_t, mask=in_block, other=-1).to(tl.int64)
    rows = in_block & (tl.cumsum((run_slots != slot).to(tl.int32), axis=0) == 0)
    return slot, leader, offs_t, rows


def masks_ranks(ranks: torch.Tensor | None, settings: KernelSettings) -> bool:
    """Whether a launch masks A and B past each slot's rank: given the slots' ranks, with KernelSettings.rank_masks."""
    return ranks is not None and settings.rank_masks == 1


@triton.jit
def slot_rank(ranks_ptr, stride_rk, slot, R, RANKS: tl.constexpr):
    """A slot's adapter's rank (its first columns of A and rows of B; the rest is zero padding), or R without a
    rank table."""
    if RANKS:
        return tl.load(ranks_ptr + slot * stride_rk)
    return R


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, part_ptr, ranks_ptr, T, K, R, R_SEG, k_per_split, skip_slot,
                   stride_xt, stride_as, stride_ak, stride_ps, stride_pt, stride_rk,
                   BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr,
                   RANKS: tl.constexpr):
    t = tl.program_id(0)
    split = tl.program_id(1)
    slot, leader, offs_t, rows = _run_rows(slots_ptr, t, T, BLOCK_T)
    if leader & (slot != skip_slot):
        offs_r = tl.arange(0, BLOCK_R)
        # the columns of A the slot's adapter fills: each module's first `rank` of its R_SEG
        mr = (offs_r < R) & (offs_r % R_SEG < slot_rank(ranks_ptr, stride_rk, slot, R_SEG, RANKS))
        acc = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32)
        k_start = split * k_per_split
        a_base = a_ptr + slot * stride_as
        for kk in range(0, k_per_split, BLOCK_K):
            offs_k = k_start + kk + tl.arange(0, BLOCK_K)
            mk = offs_k < K
            xv = tl.load(x_ptr + offs_t[:, None].to(tl.int64) * stride_xt + offs_k[None, :],
                         mask=rows[:, None] & mk[None, :], other=0.0)
            av = tl.load(a_base + offs_k[:, None] * stride_ak + offs_r[None, :],
                         mask=mk[:, None] & mr[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(xv, av, input_precision="ieee")
            else:
                acc += tl.dot(xv, av)
        tl.store(part_ptr + split * stride_ps + offs_t[:, None] * stride_pt + offs_r[None, :], acc,
                 mask=rows[:, None] & (offs_r[None, :] < R))


@triton.jit
def _segment(nb, BLOCK_N: tl.constexpr, SEG1, SEG2):
    """Which module of a fused group owns column tile nb (tiles never straddle a segment start)."""
    n0 = nb * BLOCK_N
    return (n0 >= SEG1).to(tl.int32) + (n0 >= SEG2).to(tl.int32)


@triton.jit
def _expand_kernel(part_ptr, b_ptr, scale_ptr, slots_ptr, y_ptr, ranks_ptr, T, N, R, num_splits, skip_slot, SEG1,
                   SEG2, stride_ps, stride_pt, stride_bs, stride_br, stride_ss, stride_yt, stride_rk,
                   BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr,
                   SPLITS: tl.constexpr, STORE: tl.constexpr, RANKS: tl.constexpr):
    t = tl.program_id(0)
    nb = tl.program_id(1)
    slot, leader, offs_t, rows = _run_rows(slots_ptr, t, T, BLOCK_T)
    if leader & ((slot != skip_slot) | STORE):  # STORE: zero-slot runs store zeros (their partials are unset)
        seg = _segment(nb, BLOCK_N, SEG1, SEG2)
        offs_r = tl.arange(0, BLOCK_R)
        mr = (offs_r < slot_rank(ranks_ptr, stride_rk, slot, R, RANKS)) & (offs_r < R) & (slot != skip_slot)
        # every split's partial in one 3-D load (a loop over them would wait on each load in turn)
        offs_s = tl.arange(0, SPLITS)
        parts = tl.load(part_ptr + offs_s[:, None, None] * stride_ps + offs_t[None, :, None] * stride_pt + seg * R
                        + offs_r[None, None, :],
                        mask=(offs_s[:, None, None] < num_splits) & rows[None, :, None] & mr[None, None, :],
                        other=0.0)
        s = tl.sum(parts, axis=0)
        s = s * tl.load(scale_ptr + slot * stride_ss + seg).to(tl.float32)
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        mn = offs_n < N
        bv = tl.load(b_ptr + slot * stride_bs + offs_r[:, None] * stride_br + offs_n[None, :],
                     mask=mr[:, None] & mn[None, :], other=0.0)
        if IEEE:
            delta = tl.dot(s, bv, input_precision="ieee")
        else:
            delta = tl.dot(s.to(bv.dtype), bv)
        y_ptrs = y_ptr + offs_t[:, None].to(tl.int64) * stride_yt + offs_n[None, :]
        mask = rows[:, None] & mn[None, :]
        if STORE:
            tl.store(y_ptrs, delta, mask=mask)
        else:
            yv = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_ptrs, (yv + delta).to(y_ptr.dtype.element_ty), mask=mask)


def _tile(rank: int, budget: int = 8192) -> tuple[int, int]:
    """(BLOCK_R, the other tile side) with about `budget` fp32 elements per tile (64 registers a thread)."""
    block_r = max(16, triton.next_power_of_2(rank))
    return block_r, max(32, budget // block_r)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor, skip_slot: int,
                ranks: torch.Tensor | None = None, segment: int | None = None, *, run_tokens: int = 1,
                settings: KernelSettings = _DEFAULTS) -> torch.Tensor:
    """part[s, t, :] summed over s = x[t] @ A[slot[t]]   -> [splits, T, R] float32 (rows of skipped tokens undefined).
    `ranks` ([S] int32, AdapterSlots.group_rank): only each module's first ranks[slot] of its `segment` columns
    (default: all of A's) are read, the rest being zero padding. `run_tokens`: the tokens a run of one slot is taken
    to hold (a verify pass's k + 1), so the K splits keep about settings.shrink_programs leaders busy."""
    num_tokens, fan_in = x.shape
    rank = a.shape[2]
    block_r, block_k = _tile(rank)
    block_k = min(block_k, triton.next_power_of_2(fan_in))
    chunks = triton.cdiv(fan_in, block_k)
    runs = triton.cdiv(max(num_tokens, 1), run_tokens)
    splits = max(1, min(chunks, triton.cdiv(settings.shrink_programs, runs)))
    k_per_split = triton.cdiv(chunks, splits) * block_k
    splits = triton.cdiv(fan_in, k_per_split)
    part = torch.empty(splits, num_tokens, rank, dtype=torch.float32, device=x.device)
    if num_tokens:
        _shrink_kernel[(num_tokens, splits)](
            x, a, slots, part, ranks if ranks is not None else slots, num_tokens, fan_in, rank, segment or rank,
            k_per_split, skip_slot, x.stride(0), a.stride(0), a.stride(1), part.stride(0), part.stride(1),
            ranks.stride(0) if ranks is not None else 0,
            BLOCK_T=_BLOCK_T, BLOCK_K=block_k, BLOCK_R=block_r, IEEE=x.dtype == torch.float32,
            RANKS=masks_ranks(ranks, settings), num_warps=settings.shrink_warps)
    return part


def _segment_args(segments: tuple[int, ...], fan_out: int, block_n: int) -> tuple[int, int, int]:
    """(SEG1, SEG2, BLOCK_N): the start columns of segments 1 and 2 (fan_out when absent), and a column
    tile that divides every segment start so no tile straddles two modules."""
    starts = list(segments[1:]) + [fan_out] * (3 - len(segments))
    for start in segments[1:]:
        block_n = min(block_n, start & -start)  # the largest power of two dividing the start column
    return starts[0], starts[1], block_n


def lora_expand(y: torch.Tensor, part: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor,
                skip_slot: int, segments: tuple[int, ...] = (0,), store: bool = False,
                ranks: torch.Tensor | None = None, *, settings: KernelSettings = _DEFAULTS) -> None:
    """y[t, seg cols] += sum_s part[s, t, seg*R:(seg+1)*R] @ B[slot[t], :, seg cols] * scale[slot[t], seg]
    (in place; y may be a column slice). `scale` is [S] for one module or [S, nseg] for a fused group.
    store: y (float32) = the delta itself, zero on skip_slot's rows. `ranks` ([S] int32): only the first
    ranks[slot] rows of B are read (the rest is zero padding)."""
    num_tokens, fan_out = y.shape
    rank = b.shape[1]
    block_r, block_n = _tile(rank)
    block_n = min(settings.expand_block_n or block_n, block_n)
    seg1, seg2, block_n = _segment_args(segments, fan_out, min(block_n, triton.next_power_of_2(fan_out)))
    if num_tokens:
        _expand_kernel[(num_tokens, triton.cdiv(fan_out, block_n))](
            part, b, scale, slots, y, ranks if ranks is not None else slots, num_tokens, fan_out, rank, part.shape[0],
            skip_slot, seg1, seg2, part.stride(0), part.stride(1), b.stride(0), b.stride(1), scale.stride(0),
            y.stride(0), ranks.stride(0) if ranks is not None else 0,
            BLOCK_T=_BLOCK_T, BLOCK_N=block_n, BLOCK_R=block_r, IEEE=b.dtype == torch.float32,
            SPLITS=triton.next_power_of_2(part.shape[0]), STORE=store, RANKS=masks_ranks(ranks, settings),
            num_warps=settings.expand_warps)


def expand_delta(part: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor,
                 ranks: torch.Tensor | None = None, *, settings: KernelSettings = _DEFAULTS) -> torch.Tensor:
    """sum_s part[s, t] @ B[slot[t]] * scale[slot[t]]   -> [T, out] float32, zero for tokens on the zero slot
    (S - 1). `scale` [S] or [S, 1]; `ranks` as lora_expand's."""
    out = torch.empty(part.shape[1], b.shape[2], dtype=torch.float32, device=b.device)
    lora_expand(out, part, b, scale, slots, b.shape[0] - 1, store=True, ranks=ranks, settings=settings)
    return out


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor,
               ranks: torch.Tensor | None = None, *, run_tokens: int = 1,
               settings: KernelSettings = _DEFAULTS) -> torch.Tensor:
    """(x[t] @ A[slot[t]]) @ B[slot[t]] * scale[slot[t]]   -> [T, out] float32 (the rank-space product rounded
    to B's dtype, as add_lora_triton computes it; zero on the zero slot), for a consumer that adds it. `ranks`
    ([S] int32): each slot's rank, past which A and B are zero padding and not read; `run_tokens` as lora_shrink's."""
    _check(x, x, a, b)
    part = lora_shrink(x, a, slots, a.shape[0] - 1, ranks, run_tokens=run_tokens, settings=settings)
    return expand_delta(part, b, scale, slots, ranks, settings=settings)


def group_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor,
                segments: tuple[int, ...], ranks: torch.Tensor | None = None, *, run_tokens: int = 1,
                settings: KernelSettings = _DEFAULTS) -> torch.Tensor:
    """lora_delta for every module of a fused group (add_lora_group_triton's arguments): [T, out_total] float32,
    module seg's delta in its columns, zero on the zero slot."""
    _check(x, x, a, b)
    out = torch.empty(x.shape[0], b.shape[2], dtype=torch.float32, device=b.device)
    _group(out, x, a, b, scale, slots, segments, ranks, True, run_tokens, settings)
    return out


def _group(y, x, a, b, scale, slots, segments, ranks, store: bool, run_tokens: int, settings: KernelSettings) -> None:
    """A fused group's shrink and expand into y (added, or with `store` stored): one launch each, or one each per
    module where no >= 16-column tile fits between module starts."""
    skip_slot, rank = a.shape[0] - 1, b.shape[1]
    if any(start & -start < 16 for start in segments[1:]):
        ends = list(segments[1:]) + [y.shape[1]]
        for seg, (start, end) in enumerate(zip(segments, ends)):
            part = lora_shrink(x, a[:, :, seg * rank : (seg + 1) * rank], slots, skip_slot, ranks,
                               run_tokens=run_tokens, settings=settings)
            lora_expand(y[:, start:end], part, b[:, :, start:end], scale[:, seg], slots, skip_slot, store=store,
                        ranks=ranks, settings=settings)
        return
    part = lora_shrink(x, a, slots, skip_slot, ranks, rank, run_tokens=run_tokens, settings=settings)
    lora_expand(y, part, b, scale, slots, skip_slot, segments, store=store, ranks=ranks, settings=settings)


def _check(y, x, a, b) -> None:
    if x.stride(1) != 1 or y.stride(1) != 1 or a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError("the Triton LoRA op needs unit stride along the feature dimension of x, y, A and B")


def add_lora_triton(
    y: torch.Tensor,  # [T, out] (may be a column slice of a fused output)
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [S, in, R]
    b: torch.Tensor,  # [S, R, out]
    scale: torch.Tensor,  # [S]
    slots: torch.Tensor,  # [T] long; slot S - 1 is the all-zero slot of base-only tokens
    ranks: torch.Tensor | None = None,  # [S] int32: each slot's rank, past which A and B are zero and not read
    *,
    settings: KernelSettings = _DEFAULTS,
) -> None:
    """y[i] += (x[i] @ A[slots[i]]) @ B[slots[i]] * scale[slots[i]]; lora_backend "triton"'s op."""
    _check(y, x, a, b)
    skip_slot = a.shape[0] - 1
    part = lora_shrink(x, a, slots, skip_slot, ranks, settings=settings)
    lora_expand(y, part, b, scale, slots, skip_slot, ranks=ranks, settings=settings)


def add_lora_group_triton(
    y: torch.Tensor,  # [T, out_total]: the fused output of a group's base matrices
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [S, in, nseg * R]: module seg's A in columns seg*R .. (seg+1)*R
    b: torch.Tensor,  # [S, R, out_total]: modules' B side by side, module seg from column segments[seg]
    scale: torch.Tensor,  # [S, nseg]
    slots: torch.Tensor,  # [T] long; slot S - 1 is the all-zero slot
    segments: tuple[int, ...],  # start column of each module in y (0 first)
    ranks: torch.Tensor | None = None,  # [S] int32: each slot's rank, past which A and B are zero and not read
    *,
    settings: KernelSettings = _DEFAULTS,
) -> None:
    """Every module of a fused group (q/k/v, gate/up) in one shrink and one expand launch:
    y[i, seg] += (x[i] @ A_seg[slot]) @ B_seg[slot] * scale_seg[slot]."""
    _check(y, x, a, b)
    _group(y, x, a, b, scale, slots, segments, ranks, False, 1, settings)
