"""Pure construction of one forward's flat-token metadata from per-sequence work items."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .attention import AttnMetadata


@dataclass(slots=True)
class SeqWork:
    """One sequence's share of a forward: compute positions [start, start + len(token_ids))."""

    token_ids: list[int]
    start: int  # position of token_ids[0]
    block_table: list[int]
    lora_slot: int
    num_logits: int = 1  # next-token logits wanted for the last `num_logits` query tokens
    # Positions on the device: when >= 0, every token's position is start + i + shifts[shift] (the forward's shift
    # tensor: how many more tokens an earlier step still in flight committed for this sequence than the host
    # assumed), at most shift_max more; its KV slots are then computed on the device from its block table.
    shift: int = -1
    shift_max: int = 0


# Rows of a packed forward's per-token metadata, `rows[NUM_ROWS, tokens]` (int64). Tokens are sequence-major.
IDS = 0  # input token id
POS = 1  # absolute position in its sequence
KV_SLOT = 2  # flat KV cache slot its key/value goes to: block_table[pos // block_size] * block_size + pos % block_size
SEQ = 3  # its sequence: the row of the block tables
QIDX = 4  # its index among its sequence's query tokens
LORA = 5  # its adapter slot
LOGITS = 6  # not per token: the flat token rows whose next-token logits are wanted, sequence-major
NUM_ROWS = 7  # the rows the model reads
# Rows read before the forward, on the device (`apply_sources`): where a token's input id comes from in a device token
# tensor, and which entry of a device shift tensor moves its position (-1: neither).
TOKEN_SRC = 7
SHIFT_SRC = 8
BUFFER_ROWS = 9


def pack_forward(work: list[SeqWork], block_size: int, zero_slot: int, rows: np.ndarray, tables: np.ndarray,
                 pad_to: int | None = None, pad_block: int = 0, token_src: list[int] | None = None) -> tuple[int, int]:
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
    _pack_tables(work, tables, pad_block, pad_to is not None)
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
    if rows.shape[0] >= BUFFER_ROWS:  # the device-side sources (a buffer with room for them)
        width = pad_to if pad_to is not None else num_tokens
        rows[TOKEN_SRC, :width] = -1
        if token_src is not None:
            rows[TOKEN_SRC, :num_tokens] = token_src
        rows[SHIFT_SRC, :width] = -1
        rows[SHIFT_SRC, :num_tokens] = np.array([w.shift for w in work], dtype=np.int64)[seq]
    elif token_src is not None:
        raise ValueError("token_src needs a buffer with the source rows (BUFFER_ROWS)")
    if pad_to is not None:
        pad = slice(num_tokens, pad_to)
        rows[:NUM_ROWS, pad] = 0
        rows[KV_SLOT, pad] = pad_block * block_size
        rows[SEQ, pad] = num_seqs
        rows[QIDX, pad] = np.arange(pad_to - num_tokens)  # the attention kernel tiles a sequence by query index
        rows[LORA, pad] = zero_slot
        rows[LOGITS, num_logits:pad_to] = 0  # rows nobody reads, gathered from token 0 of this forward
    return num_tokens, num_logits


def _pack_tables(work: list[SeqWork], tables: np.ndarray, pad_block: int, pad_row: bool) -> None:
    """Rows [0, B) of `tables`: each sequence's block ids, then `pad_block`; with `pad_row` row B all `pad_block`.
    Tables the engine's block manager keeps (BlockTable) are gathered from its mirror in one copy; any other (plain
    lists: warm-up, tensor-parallel workers, tests) is copied row by row."""
    num_seqs = len(work)
    mirror = getattr(work[0].block_table, "mirror", None)
    if mirror is not None:
        tabs = [w.block_table for w in work]
        try:  # (inline: a table unchanged since the last forward that read it, as most are, needs no call)
            rows = np.array([t.row if t.synced == len(t) and t.row >= 0 and t.mirror is mirror else mirror.row_of(t)
                             for t in tabs], np.int64)
        except (AttributeError, LookupError):  # a table the mirror does not keep
            mirror = None
    if mirror is None:
        tables[: num_seqs + pad_row] = pad_block
        for i, w in enumerate(work):
            tables[i, : len(w.block_table)] = w.block_table
        return
    lens = np.fromiter(map(len, tabs), np.int64, num_seqs)
    longest = int(lens.max())
    sub = tables[:num_seqs, :longest]
    sub[:] = mirror.array[rows, :longest]
    sub[np.arange(longest) >= lens[:, None]] = pad_block  # past a table's end its row holds what it held before
    tables[:num_seqs, longest:] = pad_block
    if pad_row:
        tables[num_seqs] = pad_block


def apply_sources(rows: torch.Tensor, tables: torch.Tensor, block_size: int, tokens: torch.Tensor | None,
                  shifts: torch.Tensor | None) -> None:
    """On the device, in place on packed rows [BUFFER_ROWS, T]: ids[t] = tokens[TOKEN_SRC[t]] where TOKEN_SRC >= 0;
    pos[t] += shifts[SHIFT_SRC[t]] where SHIFT_SRC >= 0, then KV_SLOT[t] = tables[SEQ[t], pos[t] // block_size] *
    block_size + pos[t] % block_size. Shape-static: no host sync, the same launches for any sources."""
    if tokens is not None:
        src = rows[TOKEN_SRC]
        rows[IDS] = torch.where(src >= 0, tokens[src.clamp_min(0)], rows[IDS])
    if shifts is not None:
        src = rows[SHIFT_SRC]
        moved = src >= 0
        pos = rows[POS] + torch.where(moved, shifts[src.clamp_min(0)], 0)
        block = tables[rows[SEQ], pos // block_size]
        rows[KV_SLOT] = torch.where(moved, block * block_size + pos % block_size, rows[KV_SLOT])
        rows[POS] = pos


def advance_forward(ids: torch.Tensor, positions: torch.Tensor, kv_slots: torch.Tensor, token_seq: torch.Tensor,
                    tables: torch.Tensor, block_size: int, tokens: torch.Tensor, start: int) -> None:
    """On the device, in place on the metadata of a forward of sequences of one token each (views of its packed
    rows, as apply_sources left them): the same forward one position on, token t's id taken from
    tokens[start + t] (what the forward before drew for it) and its KV slot recomputed from the block tables. A
    drafting pass after one with the same rows needs nothing else from the host (ModelRunner.relaunch)."""
    ids.copy_(tokens[start : start + ids.numel()])
    positions += 1
    kv_slots.copy_(tables[token_seq, positions // block_size] * block_size + positions % block_size)


@dataclass(frozen=True)
class MetadataOps:
    """The in-place fix-ups of a forward's packed metadata on the device, chosen once from the EngineConfig
    (backend.Backend.metadata): these torch references (any device), or kernels/triton_metadata.py's one launch each
    with layer_ops "triton"."""

    apply_sources: Callable[..., None] = apply_sources
    advance_forward: Callable[..., None] = advance_forward


TORCH_METADATA = MetadataOps()


@dataclass
class ForwardBatch:
    """One eager forward's metadata on the device: views of one packed [NUM_ROWS, T rounded up to 16] tensor."""

    input_ids: torch.Tensor  # [T]
    attn: AttnMetadata
    lora_slots: torch.Tensor  # [T]
    logits_indices: torch.Tensor  # [sum(num_logits)] rows of the flat token list, sequence-major
    has_lora: bool  # any token uses an adapter (else the LoRA op is skipped entirely)


def build_forward_batch(work: list[SeqWork], block_size: int, zero_slot: int, device: torch.device,
                        limits: ForwardLimits | None = None, staging=None, token_src: list[int] | None = None,
                        tokens: torch.Tensor | None = None, shifts: torch.Tensor | None = None,
                        metadata: MetadataOps = TORCH_METADATA) -> ForwardBatch:
    """pack_forward unpadded into host buffers (a set of `staging`, engine_ext.staging.Staging, pinned on a GPU;
    without it fresh arrays), moved to `device` in two non-blocking copies; then the device-side sources applied
    (`metadata.apply_sources`: input ids from `tokens` per `token_src`, positions moved by `shifts` per
    SeqWork.shift). With `limits` (debug mode) the packed indices are bounds-checked first (check_packed)."""
    num_tokens = sum(len(w.token_ids) for w in work)
    # Each row of the packed buffer is one kernel argument: a row stride of a multiple of 16 elements keeps every
    # row 128-byte aligned whatever the token count, so the kernels (which Triton specialises on 16-byte
    # alignment) see the alignment they were compiled for at warm-up.
    cols = -(-num_tokens // 16) * 16
    width = max(len(w.block_table) for w in work)
    host = staging.take(cols, len(work), width) if staging is not None else None
    buffer = host.np_rows[:, :cols] if host is not None else np.empty((BUFFER_ROWS, cols), dtype=np.int64)
    rows = buffer[:, :num_tokens]
    tables = host.np_tables[: len(work), :width] if host is not None else np.empty((len(work), width), np.int64)
    num_tokens, num_logits = pack_forward(work, block_size, zero_slot, rows, tables, token_src=token_src)
    if limits is not None:
        check_packed(rows, tables, len(work), num_tokens, num_logits, limits)
    moved = [torch.from_numpy(a) for a in (buffer, tables)]
    if host is not None and host.copied is not None:  # pinned: copied without the host waiting, then the set is free
        moved = [torch.empty(a.shape, dtype=a.dtype, device=device).copy_(a, non_blocking=True) for a in moved]
        host.copied.record()
    else:
        moved = [a.to(device) for a in moved]
    dev_rows, dev_tables = moved
    if tokens is not None or shifts is not None:
        metadata.apply_sources(dev_rows[:, :num_tokens], dev_tables, block_size, tokens, shifts)
    r = [row[:num_tokens] for row in dev_rows.unbind()]
    return ForwardBatch(
        input_ids=r[IDS],
        attn=AttnMetadata(
            positions=r[POS],
            slot_mapping=r[KV_SLOT],
            block_tables=dev_tables,
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
    max_positions, each position's block in the sequence's table (shifted positions up to their shift_max), block
    ids < num_blocks, adapter slots < num_slots, 1 <= num_logits <= tokens; and each token_src entry < tokens_len
    (the device token buffer)."""
    if not work:
        raise ForwardInputError("a forward needs at least one work item")
    for i, w in enumerate(work):
        n = len(w.token_ids)
        where = f"work item {i} (start {w.start}, {n} tokens, slot {w.lora_slot})"
        if n == 0 or not 1 <= w.num_logits <= n:
            raise ForwardInputError(f"{where}: num_logits {w.num_logits} must be in [1, {n}]")
        end = w.start + n + max(0, w.shift_max) * (w.shift >= 0)  # past its last position, shifted at most
        if w.start < 0 or end > limits.max_positions:
            raise ForwardInputError(f"{where}: positions up to {end - 1} exceed {limits.max_positions - 1}")
        if min(w.token_ids) < 0 or max(w.token_ids) >= limits.vocab_size:
            raise ForwardInputError(f"{where}: a token id is outside [0, {limits.vocab_size})")
        if -(-end // limits.block_size) > len(w.block_table):
            raise ForwardInputError(f"{where}: its {len(w.block_table)} KV blocks do not cover position {end - 1}")
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
