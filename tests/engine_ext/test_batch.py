"""Pure batch metadata: flat tokens, positions, cache slots, block tables, logits rows."""

import torch

from engine_ext.batch import SeqWork, build_forward_batch


def test_prefill_and_decode_mixed():
    work = [
        SeqWork(token_ids=[5, 6, 7], start=0, block_table=[3, 1], lora_slot=0),  # prefill
        SeqWork(token_ids=[9], start=5, block_table=[2, 4], lora_slot=8),  # decode at position 5
        SeqWork(token_ids=[1, 2], start=3, block_table=[0, 7], lora_slot=8, num_logits=2),  # verify-like
    ]
    b = build_forward_batch(work, block_size=4, zero_slot=8, device=torch.device("cpu"))
    assert b.input_ids.tolist() == [5, 6, 7, 9, 1, 2]
    assert b.attn.positions.tolist() == [0, 1, 2, 5, 3, 4]
    # position p of a sequence lives at block_table[p // 4] * 4 + p % 4
    assert b.attn.slot_mapping.tolist() == [12, 13, 14, 4 * 4 + 1, 3, 7 * 4]
    assert b.attn.block_tables.tolist() == [[3, 1], [2, 4], [0, 7]]
    assert b.attn.token_seq.tolist() == [0, 0, 0, 1, 2, 2]
    assert b.attn.token_qidx.tolist() == [0, 1, 2, 0, 0, 1]
    assert b.attn.max_query_len == 3
    assert b.lora_slots.tolist() == [0, 0, 0, 8, 8, 8]
    assert b.logits_indices.tolist() == [2, 3, 4, 5]
    assert b.has_lora


def test_base_only_batch_skips_lora():
    work = [SeqWork(token_ids=[1], start=0, block_table=[0], lora_slot=2)]
    assert not build_forward_batch(work, 16, zero_slot=2, device=torch.device("cpu")).has_lora
