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
