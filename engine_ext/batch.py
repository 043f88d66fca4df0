"""Pure construction of one forward's flat-token metadata from per-sequence work items."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from .attention import AttnMetadata


@dataclass
class SeqWork:
    """One sequence's share of a forward: compute positions [start, start + len(token_ids))."""

    token_ids: list[int]
    start: int  # position of token_ids[0]
    block_table: list[int]
    lora_slot: int
    num_logits: int = 1  # next-token logits wanted for the last `num_logits` query tokens


# Rows of a packed forward's per-token metadata, `rows[NUM_ROWS, tokens]` (int64). Tokens are sequence-major.
IDS = 0  # input token id
POS = 1  # absolute position in its sequence
KV_SLOT = 2  # flat KV cache slot its key/value goes to: block_table[pos // block_size] * block_size + pos % block_size
SEQ = 3  # its sequence: the row of the block tables
QIDX = 4  # its index among its sequence's query tokens
LORA = 5  # its adapter slot
LOGITS = 6  # not per token: the flat token rows whose next-token logits are wanted, sequence-major
NUM_ROWS = 7


def pack_forward(work: list[SeqWork], block_size: int, zero_slot: int, rows: np.ndarray, tables: np.ndarray,
                 pad_to: int | None = None, pad_block: int = 0) -> tuple[int, int]:
    """Fill `rows` ([>= NUM_ROWS, >= T] int64) and `tables` ([>= B, W] int64) for one forward of T tokens from B
    sequences, with N logits rows; returns (T, N). The one packer of the eager and the CUDA-graph forwards.

    Written: columns [0, T) of every row, [0, N) of the logits row, and table rows [0, B) over their whole width
    (a sequence's block ids, then `pad_block`). With `pad_to` (a graph's token bucket, >= T) also everything a
    `pad_to`-token graph reads beyond that, so that buffers reused from forward to forward hold nothing from an
    earlier batch: tokens [T, pad_to) are padding (id 0 at position 0 of block `pad_block`, in an extra
    sequence B whose table row is all `pad_block`, query indices 0, 1, ..., on the zero adapter slot), and logits
    rows [N, pad_to) are 0.
    A logits row left over from a larger batch would make the graph gather past the end of its buffers."""
    num_seqs = len(work)
    per_seq = np.array([(len(w.token_ids), w.num_logits, w.start, w.lora_slot) for w in work], dtype=np.int64)
    lens, nlog, starts, lora = per_seq.T
    ends, log_ends = np.add.accumulate(lens), np.add.accumulate(nlog)  # flat index past each sequence's tokens
    num_tokens, num_logits = int(ends[-1]), int(log_ends[-1])
    if pad_to is not None and num_tokens > pad_to:
        raise ValueError(f"{num_tokens} tokens do not fit the {pad_to}-token graph")
    tables[: num_seqs + (pad_to is not None)] = pad_block
    for i, w in enumerate(work):
        tables[i, : len(w.block_table)] = w.block_table
    seq = np.repeat(np.arange(num_seqs), lens)
    qidx = np.arange(num_tokens) - (ends - lens)[seq]
    pos = starts[seq] + qidx
    block, offset = np.divmod(pos, block_size)
    rows[IDS, :num_tokens] = np.fromiter(itertools.chain.from_iterable(w.token_ids for w in work), dtype=np.int64,
                                         count=num_tokens)
    rows[POS, :num_tokens] = pos
    rows[KV_SLOT, :num_tokens] = tables[seq, block] * block_size + offset
    rows[SEQ, :num_tokens] = seq
    rows[QIDX, :num_tokens] = qidx
    rows[LORA, :num_tokens] = lora[seq]
    # Flat logits row k, of sequence i, is token ends[i] - (log_ends[i] - k): the sequence's last tokens in order.
    rows[LOGITS, :num_logits] = np.repeat(ends - log_ends, nlog) + np.arange(num_logits)
    if pad_to is not None:
        pad = slice(num_tokens, pad_to)
        rows[:NUM_ROWS, pad] = 0
        rows[KV_SLOT, pad] = pad_block * block_size
        rows[SEQ, pad] = num_seqs
        rows[QIDX, pad] = np.arange(pad_to - num_tokens)  # the attention kernel tiles a sequence by query index
        rows[LORA, pad] = zero_slot
        rows[LOGITS, num_logits:pad_to] = 0  # rows nobody reads, gathered from token 0 of this forward
    return num_tokens, num_logits


def token_moves(token_src: list[int] | None) -> tuple[np.ndarray, np.ndarray]:
    """(dst, src): flat tokens whose input id comes from the caller's device tensor, and the entries they read."""
    if token_src is None:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    src = np.asarray(token_src, dtype=np.int64)
    dst = np.flatnonzero(src >= 0)
    return dst, src[dst]


@dataclass
class ForwardBatch:
    """One eager forward's metadata on the device: views of one packed [NUM_ROWS, T rounded up to 16] tensor."""

    input_ids: torch.Tensor  # [T]
    attn: AttnMetadata
    lora_slots: torch.Tensor  # [T]
    logits_indices: torch.Tensor  # [sum(num_logits)] rows of the flat token list, sequence-major
    has_lora: bool  # any token uses an adapter (else the LoRA op is skipped entirely)


def build_forward_batch(work: list[SeqWork], block_size: int, zero_slot: int, device: torch.device,
                        limits: ForwardLimits | None = None) -> ForwardBatch:
    """pack_forward unpadded into fresh host arrays, moved to `device` in two copies. With `limits` (debug mode)
    the packed indices are bounds-checked first (check_packed)."""
    num_tokens = sum(len(w.token_ids) for w in work)
    # Each row of the packed buffer is one kernel argument: a row stride of a multiple of 16 elements keeps every
    # row 128-byte aligned whatever the token count, so the kernels (which Triton specialises on 16-byte
    # alignment) see the alignment they were compiled for at warm-up.
    buffer = np.empty((NUM_ROWS, -(-num_tokens // 16) * 16), dtype=np.int64)
    rows = buffer[:, :num_tokens]
    tables = np.empty((len(work), max(len(w.block_table) for w in work)), dtype=np.int64)
    num_tokens, num_logits = pack_forward(work, block_size, zero_slot, rows, tables)
    if limits is not None:
        check_packed(rows, tables, len(work), num_tokens, num_logits, limits)
    r = [row[:num_tokens] for row in torch.from_numpy(buffer).to(device).unbind()]
    return ForwardBatch(
        input_ids=r[IDS],
        attn=AttnMetadata(
            positions=r[POS],
            slot_mapping=r[KV_SLOT],
            block_tables=torch.from_numpy(tables).to(device),
            token_seq=r[SEQ],
            token_qidx=r[QIDX],
            max_query_len=max(len(w.token_ids) for w in work),
        ),
        lora_slots=r[LORA],
        logits_indices=r[LOGITS][:num_logits],
        has_lora=any(w.lora_slot != zero_slot for w in work),
    )


@dataclass(frozen=True)
class ForwardLimits:
    """What a forward's indices may address: the host-side bounds `check_work` holds work items to."""

    vocab_size: int
    max_positions: int  # rotary table rows
    num_blocks: int  # KV blocks the block manager hands out: valid block ids are [0, num_blocks)
    block_size: int
    num_slots: int  # adapter slots, the zero slot included


class ForwardInputError(ValueError):
    """A forward's metadata would read or write outside its buffers (a scheduler or packing bug)."""


def check_work(work: list[SeqWork], limits: ForwardLimits, tokens_len: int | None = None,
               token_src: list[int] | None = None) -> None:
    """Raise ForwardInputError unless every index `work` implies is in bounds: token ids < vocab, positions <
    max_positions, each position's block in the sequence's table, block ids < num_blocks, adapter slots <
    num_slots, 1 <= num_logits <= tokens; and each token_src entry < tokens_len (the device token buffer)."""
    if not work:
        raise ForwardInputError("a forward needs at least one work item")
    for i, w in enumerate(work):
        n = len(w.token_ids)
        where = f"work item {i} (start {w.start}, {n} tokens, slot {w.lora_slot})"
        if n == 0 or not 1 <= w.num_logits <= n:
            raise ForwardInputError(f"{where}: num_logits {w.num_logits} must be in [1, {n}]")
        if w.start < 0 or w.start + n > limits.max_positions:
            raise ForwardInputError(f"{where}: positions up to {w.start + n - 1} exceed {limits.max_positions - 1}")
        if min(w.token_ids) < 0 or max(w.token_ids) >= limits.vocab_size:
            raise ForwardInputError(f"{where}: a token id is outside [0, {limits.vocab_size})")
        if -(-(w.start + n) // limits.block_size) > len(w.block_table):
            raise ForwardInputError(f"{where}: its {len(w.block_table)} KV blocks do not cover position "
                                    f"{w.start + n - 1}")
        if w.block_table and (min(w.block_table) < 0 or max(w.block_table) >= limits.num_blocks):
            raise ForwardInputError(f"{where}: a block id is outside [0, {limits.num_blocks})")
        if not 0 <= w.lora_slot < limits.num_slots:
            raise ForwardInputError(f"{where}: adapter slot outside [0, {limits.num_slots})")
    if token_src is not None:
        total = sum(len(w.token_ids) for w in work)
        if len(token_src) != total:
            raise ForwardInputError(f"token_src has {len(token_src)} entries for {total} tokens")
        if tokens_len is None or max(token_src) >= tokens_len:
            raise ForwardInputError(f"token_src reads up to {max(token_src)} of a {tokens_len}-token buffer")


def check_packed(rows: np.ndarray, tables: np.ndarray, num_seqs: int, num_tokens: int, num_logits: int,
                 limits: ForwardLimits, pad_to: int | None = None, pad_block: int = 0) -> None:
    """Raise ForwardInputError unless every index the forward reads from what pack_forward wrote (with the same
    `pad_to` and `pad_block`) stays in its buffers: the debug-mode check before the forward is queued. Padded,
    a `pad_to`-token graph reads every column below `pad_to`, one more sequence and block `pad_block`."""
    def within(name: str, values: np.ndarray, high: int) -> None:
        if values.size and (values.min() < 0 or values.max() >= high):
            raise ForwardInputError(f"{name} outside [0, {high}) in a {width}-token forward: "
                                    f"{values.min()}..{values.max()}")

    padded = pad_to is not None
    width = pad_to if padded else num_tokens
    blocks = pad_block + 1 if padded else limits.num_blocks
    cols = slice(0, width)
    within("token ids", rows[IDS, cols], limits.vocab_size)
    within("positions", rows[POS, cols], limits.max_positions)
    within("KV slots", rows[KV_SLOT, cols], blocks * limits.block_size)
    within("sequence indices", rows[SEQ, cols], num_seqs + padded)
    within("query indices", rows[QIDX, cols], width)
    within("adapter slots", rows[LORA, cols], limits.num_slots)
    within("logits rows", rows[LOGITS, :num_logits], num_tokens)
    if padded:  # the graph gathers all `pad_to` rows; unpadded, only the first num_logits are written or read
        within("logits rows", rows[LOGITS, cols], width)
    within("block tables", tables[: num_seqs + padded], blocks)
