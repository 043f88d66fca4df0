"""Paged attention in Triton for decode and for the speculative verify pass (several query tokens
per sequence), one program per (run of query tokens, KV head).

    out[t, h] = softmax(q[t, h] . K[seq(t), :pos(t)+1]^T * scale) @ V[seq(t), :pos(t)+1]

(same contract as attention.paged_attention). A token leads a run when its index among its
sequence's query tokens is a multiple of BLOCK_QW (its first token, then every BLOCK_QW-th); the
leader's program takes up to BLOCK_QW query tokens of its sequence times the GROUP query heads
sharing one KV head as one tile, so every K/V page is read once per run and head group (a verify
pass's k+1 tokens share one run when k+1 <= BLOCK_QW, wherever they sit in the flat token list),
with a per-row causal mask and an online softmax. A run of at most BLOCK_Q tokens (a decoding
sequence's one) takes the narrower tile of BLOCK_Q tokens instead, chosen on the device, so the
wide tile of a forward with several query tokens per sequence (KernelSettings.attn_rows_multi)
costs its one-token sequences nothing. Positions and block-table rows are read on the
device, so the kernel needs no host-side lengths: a CUDA graph captured once replays for any mix
of context lengths; programs of non-leaders return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..attention import AttnMetadata
from .pdl import launch, wait_then_release
from .settings import KernelSettings

_DEFAULTS = KernelSettings()


@triton.jit
def _load_kv(k_ptr, v_ptr, tables_ptr, seq, stride_bt, start, hi, stride_kb, stride_ks, head_off,
             PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """K and V [BLOCK_N, HEAD_DIM] of key positions start.. (zeros beyond hi)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    in_seq = offs_n <= hi
    page = tl.load(tables_ptr + seq * stride_bt + offs_n // PAGE, mask=in_seq, other=0).to(tl.int64)
    kv_off = page * stride_kb + (offs_n % PAGE) * stride_ks + head_off
    k = tl.load(k_ptr + kv_off[:, None] + offs_d[None, :], mask=in_seq[:, None], other=0.0)
    v = tl.load(v_ptr + kv_off[:, None] + offs_d[None, :], mask=in_seq[:, None], other=0.0)
    return k, v


# The block-table row stride is the widest table of the forward: in an eager forward (a prefill past the graphs) any
# width, and Triton would compile a variant for a width of 1 and one for a multiple of 16 the first time a batch has
# one, while serving (a burst whose longest prompt fills 32 blocks did). Not specialised: one variant for every width.
@triton.jit(do_not_specialize=["stride_bt"])
def _paged_attn_kernel(q_ptr, k_ptr, v_ptr, out_ptr, ml_ptr, tables_ptr, token_seq_ptr, qidx_ptr, positions_ptr, T,
                       scale, window, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ot,
                       stride_oh,
                       GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_QW: tl.constexpr,
                       HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
                       IEEE: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(token_seq_ptr + t).to(tl.int64)
    if tl.load(qidx_ptr + t) % BLOCK_QW == 0:  # t leads a run of up to BLOCK_QW of its sequence's query tokens
        if BLOCK_QW > BLOCK_Q:
            # the wide tile only where the run has more tokens than the narrow one holds (a one-token sequence
            # would pay the padded rows)
            nxt = t + BLOCK_Q
            wide = tl.load(token_seq_ptr + nxt, mask=nxt < T, other=-1).to(tl.int64) == seq
            if wide:
                _attend(q_ptr, k_ptr, v_ptr, out_ptr, ml_ptr, tables_ptr, token_seq_ptr, positions_ptr, T, t, seq,
                        kvh, split, scale, window, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
                        stride_ot, stride_oh, GROUP, GROUP_PAD, BLOCK_QW, HEAD_DIM, PAGE, BLOCK_N, SPLITS, IEEE)
            else:
                _attend(q_ptr, k_ptr, v_ptr, out_ptr, ml_ptr, tables_ptr, token_seq_ptr, positions_ptr, T, t, seq,
                        kvh, split, scale, window, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
                        stride_ot, stride_oh, GROUP, GROUP_PAD, BLOCK_Q, HEAD_DIM, PAGE, BLOCK_N, SPLITS, IEEE)
        else:
            _attend(q_ptr, k_ptr, v_ptr, out_ptr, ml_ptr, tables_ptr, token_seq_ptr, positions_ptr, T, t, seq, kvh,
                    split, scale, window, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ot,
                    stride_oh, GROUP, GROUP_PAD, BLOCK_Q, HEAD_DIM, PAGE, BLOCK_N, SPLITS, IEEE)


@triton.jit
def _attend(q_ptr, k_ptr, v_ptr, out_ptr, ml_ptr, tables_ptr, token_seq_ptr, positions_ptr, T, t, seq, kvh, split,
            scale, window, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ot, stride_oh,
            GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
            PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr):
    """The run of up to BLOCK_Q query tokens of sequence `seq` from token t, for the query heads of KV head kvh: one
    tile, each K/V page of its key range (this split's share) read once."""
    # Tile rows: BLOCK_Q query tokens x GROUP_PAD heads sharing KV head kvh; row r = (r // GROUP_PAD, r % GROUP_PAD).
    # A sequence's query tokens are consecutive: the run is the tokens after t of t's sequence.
    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    tok = t + rows // GROUP_PAD
    head = kvh * GROUP + rows % GROUP_PAD
    in_block = tok < T
    tok_seq = tl.load(token_seq_ptr + tok, mask=in_block, other=-1).to(tl.int64)
    valid_row = in_block & (tok_seq == seq) & (rows % GROUP_PAD < GROUP)
    pos_leader = tl.load(positions_ptr + t).to(tl.int32)
    pos = tl.load(positions_ptr + tok, mask=valid_row, other=0).to(tl.int32)
    pos = tl.where(valid_row, pos, pos_leader)  # padding rows mirror the leader: finite, never stored
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + tok[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=valid_row[:, None], other=0.0)
    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    hi = tl.max(pos, axis=0)
    lo = 0
    if window > 0:
        lo = tl.maximum(tl.min(pos, axis=0) - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    # Split-KV: this program takes its share of the key blocks; the partial (max, sum, unnormalised
    # output) of every split is merged by _combine_kernel.
    num_blocks = tl.cdiv(hi + 1 - lo, BLOCK_N)
    per_split = tl.cdiv(num_blocks, SPLITS)
    first = split * per_split
    last = tl.minimum(num_blocks, first + per_split)
    for blk in range(first, last):
        start = lo + blk * BLOCK_N
        offs_n = start + tl.arange(0, BLOCK_N)
        # V is issued with K, so both loads are in flight while the scores are computed
        k, v = _load_kv(k_ptr, v_ptr, tables_ptr, seq, stride_bt, start, hi, stride_kb, stride_ks,
                        kvh * stride_kh, PAGE, BLOCK_N, HEAD_DIM)
        if IEEE:  # float32 caches: full-precision products, not tf32
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale  # [rows, BLOCK_N]
        allowed = offs_n[None, :] <= pos[:, None]
        if window > 0:
            allowed = allowed & (offs_n[None, :] > pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing allowed yet stays at 0
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(out_ptr + tok[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=valid_row[:, None])
    else:  # partials, row (token, head, split): out_ptr is fp32 [T, H, SPLITS, D], ml_ptr [T, H, SPLITS, 2]
        row = (tok.to(tl.int64) * (stride_ot // (SPLITS * HEAD_DIM)) + head) * SPLITS + split
        tl.store(out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=valid_row[:, None])
        tl.store(ml_ptr + row * 2, m_i, mask=valid_row)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=valid_row)


@triton.jit
def _combine_kernel(part_ptr, ml_ptr, out_ptr, H, stride_ot, stride_oh,
                    SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    row = (t * H + h) * SPLITS + offs_s
    m = tl.load(ml_ptr + row * 2)
    l = tl.load(ml_ptr + row * 2 + 1)
    m_max = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))  # an empty split weighs nothing
    acc = tl.load(part_ptr + row[:, None] * HEAD_DIM + offs_d[None, :])
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))


def paged_attention_triton(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    meta: AttnMetadata,
    scale: float,
    sliding_window: int | None = None,
    *,
    settings: KernelSettings = _DEFAULTS,
) -> torch.Tensor:
    """out[t] = softmax(q[t] . K[seq(t), :pos(t)+1]^T * scale) @ V[seq(t), :pos(t)+1]   -> [T, H, D].
    `settings`: the launch settings (attn_*), which change speed, never results."""
    num_tokens, heads, head_dim = q.shape
    _, page, kv_heads, _ = k_cache.shape
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"paged_attention_triton needs a power-of-two head_dim >= 16, got {head_dim}")
    if k_cache.stride(3) != 1 or v_cache.stride() != k_cache.stride() or q.stride(2) != 1:
        raise ValueError("paged_attention_triton needs contiguous head_dim and identically laid out K/V caches")
    group = heads // kv_heads
    out = torch.empty(num_tokens, heads, head_dim, dtype=q.dtype, device=q.device)
    tables = meta.block_tables
    if not num_tokens:
        return out
    group_pad = triton.next_power_of_2(group)
    block_n, stages = kv_tile(head_dim, k_cache.element_size(), settings)
    narrow = block_q(group_pad, settings.attn_rows)
    multi = settings.attn_rows_multi and meta.multi
    wide = max(narrow, block_q(group_pad, settings.attn_rows_multi)) if multi else narrow
    splits = kv_splits(num_tokens, kv_heads, settings)
    if splits == 1:
        part, ml, strides = out, out, (out.stride(0), out.stride(1))
    else:
        part = torch.empty(num_tokens, heads, splits, head_dim, dtype=torch.float32, device=q.device)
        ml = torch.empty(num_tokens, heads, splits, 2, dtype=torch.float32, device=q.device)
        strides = (part.stride(0), part.stride(1))
    pdl = launch(num_tokens, q.device, settings.pdl_max_tokens)
    _paged_attn_kernel[(num_tokens, kv_heads, splits)](
        q, k_cache, v_cache, part, ml, tables, meta.token_seq, meta.token_qidx, meta.positions, num_tokens, scale,
        sliding_window or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0),
        *strides, GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=narrow, BLOCK_QW=wide, HEAD_DIM=head_dim, PAGE=page,
        BLOCK_N=block_n, SPLITS=splits, IEEE=q.dtype == torch.float32, num_warps=settings.attn_warps, **pdl,
        **({"num_stages": stages} if stages else {}))
    if splits > 1:
        _combine_kernel[(num_tokens, heads)](part, ml, out, heads, out.stride(0), out.stride(1), SPLITS=splits,
                                             HEAD_DIM=head_dim, num_warps=1, **pdl)
    return out


_SMEM_BUDGET = 160 << 10  # bytes of K/V tiles in flight (H200: 227 KB of shared memory per block)


def kv_splits(num_tokens: int, kv_heads: int, settings: KernelSettings) -> int:
    """Split-KV shares per context ("flash decoding"; see KernelSettings.attn_split_budget): sized from the
    token count alone, so one CUDA graph serves every context length."""
    budget = settings.attn_split_budget // (num_tokens * kv_heads)
    return max(1, min(settings.attn_max_splits, triton.next_power_of_2(max(1, budget))))


def block_q(group_pad: int, rows: int) -> int:
    """Query tokens per tile: the tile (block_q x group_pad rows) has at least 16 rows (the tensor-core dot);
    `rows` is KernelSettings.attn_rows."""
    least = max(1, 16 // group_pad)
    return max(least, rows // group_pad) if rows else max(8, least)


def kv_tile(head_dim: int, element_size: int, settings: KernelSettings) -> tuple[int, int]:
    """(BLOCK_N, stages): the K and V tiles of every pipeline stage fit the shared-memory budget (wide heads
    and float32 caches take smaller key blocks)."""
    block_n, stages = settings.attn_block_n, settings.attn_stages
    buffers = stages or 3  # 0: Triton's default, 3 stages on NVIDIA
    while block_n > 16 and 2 * buffers * block_n * head_dim * element_size > _SMEM_BUDGET:
        block_n //= 2
    return block_n, stages
