"""Pure construction of one forward's flat-token metadata from per-sequence work items."""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    attn: AttnMetadata
    lora_slots: torch.Tensor  # [T]
    logits_indices: torch.Tensor  # [sum(num_logits)] rows of the flat token list, sequence-major
    has_lora: bool  # any token uses an adapter (else the LoRA op is skipped entirely)


def build_forward_batch(work: list[SeqWork], block_size: int, zero_slot: int, device: torch.device) -> ForwardBatch:
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    token_seq: list[int] = []
    token_qidx: list[int] = []
    lora_slots: list[int] = []
    logits_indices: list[int] = []
    max_blocks = max(len(w.block_table) for w in work)
    for i, w in enumerate(work):
        n = len(w.token_ids)
        base = len(input_ids)
        for j in range(n):
            pos = w.start + j
            positions.append(pos)
            slot_mapping.append(w.block_table[pos // block_size] * block_size + pos % block_size)
        input_ids.extend(w.token_ids)
        token_seq.extend([i] * n)
        token_qidx.extend(range(n))
        lora_slots.extend([w.lora_slot] * n)
        logits_indices.extend(range(base + n - w.num_logits, base + n))
    tables = [w.block_table + [0] * (max_blocks - len(w.block_table)) for w in work]

    def t(x):
        return torch.tensor(x, dtype=torch.long, device=device)

    return ForwardBatch(
        input_ids=t(input_ids),
        attn=AttnMetadata(
            positions=t(positions),
            slot_mapping=t(slot_mapping),
            block_tables=t(tables),
            token_seq=t(token_seq),
            token_qidx=t(token_qidx),
            max_query_len=max(len(w.token_ids) for w in work),
        ),
        lora_slots=t(lora_slots),
        logits_indices=t(logits_indices),
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
