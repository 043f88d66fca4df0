"""A forward's metadata fix-ups on the device in Triton: batch.apply_sources and batch.advance_forward, one launch
each (layer_ops "triton").

The torch references run about a dozen element-wise launches each on a few hundred int64 values, and at that size
a launch's host cost is all there is (a speculative cycle runs one of them per forward). Each kernel here does the
same in-place work in one launch, a program per BLOCK tokens, every value int64:

- apply_sources:   ids[t] = tokens[TOKEN_SRC[t]] where TOKEN_SRC[t] >= 0; pos[t] += shifts[SHIFT_SRC[t]] and
                   KV_SLOT[t] = tables[SEQ[t], pos[t] // B] * B + pos[t] % B where SHIFT_SRC[t] >= 0
- advance_forward: ids[t] = tokens[start + t]; pos[t] += 1; kv_slots[t] = tables[seq[t], pos[t] // B] * B + pos[t] % B

Positions are never negative (so Triton's truncating // and % are torch's floor ones). Nothing is specialised on
a value or an alignment (token counts, strides, `start`, whether there are tokens or shifts are plain runtime
arguments), so each kernel compiles once, at warm-up (ModelRunner.warm_up), never for a new batch size mid-serving.
Neither wrapper reads anything back from the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..batch import IDS, KV_SLOT, POS, SEQ, SHIFT_SRC, TOKEN_SRC

_BLOCK = 128  # tokens of one program
_IDS, _POS, _KV_SLOT, _SEQ = tl.constexpr(IDS), tl.constexpr(POS), tl.constexpr(KV_SLOT), tl.constexpr(SEQ)
_TOKEN_SRC, _SHIFT_SRC = tl.constexpr(TOKEN_SRC), tl.constexpr(SHIFT_SRC)
# Every runtime argument of each kernel, none specialised on its value or alignment: one compiled variant each
_SOURCES_ARGS = ["rows_ptr", "tables_ptr", "tokens_ptr", "shifts_ptr", "num_tokens", "stride_r", "stride_ts",
                 "stride_tb", "stride_k", "stride_s", "block_size", "has_tokens", "has_shifts"]
_ADVANCE_ARGS = ["ids_ptr", "pos_ptr", "kv_ptr", "seq_ptr", "tables_ptr", "tokens_ptr", "num_tokens", "start",
                 "stride_i", "stride_p", "stride_kv", "stride_q", "stride_ts", "stride_tb", "stride_k", "block_size"]


@triton.jit
def _kv_slot(tables_ptr, seq, pos, stride_ts, stride_tb, block_size, mask):
    """tables[seq, pos // block_size] * block_size + pos % block_size (int64), where `mask`."""
    block = tl.load(tables_ptr + seq * stride_ts + (pos // block_size) * stride_tb, mask=mask, other=0).to(tl.int64)
    return block * block_size + pos % block_size


@triton.jit(do_not_specialize=_SOURCES_ARGS, do_not_specialize_on_alignment=_SOURCES_ARGS)
def _apply_sources_kernel(rows_ptr, tables_ptr, tokens_ptr, shifts_ptr, num_tokens, stride_r, stride_ts, stride_tb,
                          stride_k, stride_s, block_size, has_tokens, has_shifts, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = t < num_tokens
    if has_tokens != 0:
        src = tl.load(rows_ptr + _TOKEN_SRC * stride_r + t, mask=live, other=-1)
        take = src >= 0
        ids = tl.load(tokens_ptr + src * stride_k, mask=take, other=0).to(tl.int64)
        tl.store(rows_ptr + _IDS * stride_r + t, ids, mask=take)
    if has_shifts != 0:
        src = tl.load(rows_ptr + _SHIFT_SRC * stride_r + t, mask=live, other=-1)
        moved = src >= 0
        shift = tl.load(shifts_ptr + src * stride_s, mask=moved, other=0).to(tl.int64)
        pos = tl.load(rows_ptr + _POS * stride_r + t, mask=moved, other=0) + shift
        seq = tl.load(rows_ptr + _SEQ * stride_r + t, mask=moved, other=0)
        slot = _kv_slot(tables_ptr, seq, pos, stride_ts, stride_tb, block_size, moved)
        # Unmoved tokens keep their position and slot: the reference writes them back unchanged
        tl.store(rows_ptr + _POS * stride_r + t, pos, mask=moved)
        tl.store(rows_ptr + _KV_SLOT * stride_r + t, slot, mask=moved)


def apply_sources_triton(rows: torch.Tensor, tables: torch.Tensor, block_size: int, tokens: torch.Tensor | None,
                         shifts: torch.Tensor | None) -> None:
    """batch.apply_sources in one launch: ids[t] = tokens[TOKEN_SRC[t]] where >= 0; pos[t] += shifts[SHIFT_SRC[t]]
    and its KV slot from `tables` where SHIFT_SRC[t] >= 0. `rows` [BUFFER_ROWS, T] may be a column slice of a wider
    buffer (any row stride, unit column stride); tokens and shifts are 1-D."""
    num_tokens = rows.shape[1]
    if (tokens is None and shifts is None) or not num_tokens:
        return
    if rows.stride(1) != 1:
        raise ValueError("apply_sources_triton needs rows of unit column stride")
    # an absent source's pointer is never read (its flag is 0): any int64 tensor stands in for it
    _apply_sources_kernel[(triton.cdiv(num_tokens, _BLOCK),)](
        rows, tables, rows if tokens is None else tokens, rows if shifts is None else shifts, num_tokens,
        rows.stride(0), tables.stride(0), tables.stride(1), 0 if tokens is None else tokens.stride(0),
        0 if shifts is None else shifts.stride(0), block_size, int(tokens is not None), int(shifts is not None),
        BLOCK=_BLOCK)


@triton.jit(do_not_specialize=_ADVANCE_ARGS, do_not_specialize_on_alignment=_ADVANCE_ARGS)
def _advance_forward_kernel(ids_ptr, pos_ptr, kv_ptr, seq_ptr, tables_ptr, tokens_ptr, num_tokens, start, stride_i,
                            stride_p, stride_kv, stride_q, stride_ts, stride_tb, stride_k, block_size,
                            BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = t < num_tokens
    ids = tl.load(tokens_ptr + (start + t) * stride_k, mask=live, other=0).to(tl.int64)
    tl.store(ids_ptr + t * stride_i, ids, mask=live)
    pos = tl.load(pos_ptr + t * stride_p, mask=live, other=0) + 1
    tl.store(pos_ptr + t * stride_p, pos, mask=live)
    seq = tl.load(seq_ptr + t * stride_q, mask=live, other=0)
    slot = _kv_slot(tables_ptr, seq, pos, stride_ts, stride_tb, block_size, live)
    tl.store(kv_ptr + t * stride_kv, slot, mask=live)


def advance_forward_triton(ids: torch.Tensor, positions: torch.Tensor, kv_slots: torch.Tensor,
                           token_seq: torch.Tensor, tables: torch.Tensor, block_size: int, tokens: torch.Tensor,
                           start: int) -> None:
    """batch.advance_forward in one launch: ids[t] = tokens[start + t]; positions[t] += 1; kv_slots[t] =
    tables[token_seq[t], positions[t] // block_size] * block_size + positions[t] % block_size. The four are 1-D
    views (rows of one packed buffer, or tensors of their own)."""
    num_tokens = ids.numel()
    if start < 0 or start + num_tokens > tokens.numel():  # what the reference's copy refuses, checked on the host
        raise ValueError(f"tokens[{start}:{start + num_tokens}] is outside a {tokens.numel()}-token buffer")
    if not num_tokens:
        return
    _advance_forward_kernel[(triton.cdiv(num_tokens, _BLOCK),)](
        ids, positions, kv_slots, token_seq, tables, tokens, num_tokens, start, ids.stride(0), positions.stride(0),
        kv_slots.stride(0), token_seq.stride(0), tables.stride(0), tables.stride(1), tokens.stride(0), block_size,
        BLOCK=_BLOCK)
