"""Pure batch metadata: flat tokens, positions, cache slots, block tables, logits rows."""

import numpy as np
import pytest
import torch

from engine_ext.batch import (BUFFER_ROWS, IDS, KV_SLOT, LOGITS, LORA, NUM_ROWS, POS, QIDX, SEQ, SHIFT_SRC, TOKEN_SRC,
                              MetadataOps, SeqWork, advance_forward, apply_sources, build_forward_batch, pack_forward)

BLOCK, ZERO = 4, 8

# Each case: work items, then the packed rows (columns [0, T), logits [0, N)) and the block tables, unpadded.
# A token at position p of a sequence lives in KV slot block_table[p // 4] * 4 + p % 4.
CASES = {
    "prefill, decode and verify mixed": (
        [SeqWork([5, 6, 7], 0, [3, 1], lora_slot=0),  # prefill
         SeqWork([9], 5, [2, 4], lora_slot=ZERO),  # decode at position 5
         SeqWork([1, 2], 3, [0, 7], lora_slot=ZERO, num_logits=2)],  # verify-like, crosses a block boundary
        {IDS: [5, 6, 7, 9, 1, 2], POS: [0, 1, 2, 5, 3, 4], KV_SLOT: [12, 13, 14, 4 * 4 + 1, 3, 7 * 4],
         SEQ: [0, 0, 0, 1, 2, 2], QIDX: [0, 1, 2, 0, 0, 1], LORA: [0, 0, 0, 8, 8, 8], LOGITS: [2, 3, 4, 5]},
        [[3, 1], [2, 4], [0, 7]],
    ),
    "one decode token": (
        [SeqWork([42], 6, [5, 2], lora_slot=3)],
        {IDS: [42], POS: [6], KV_SLOT: [2 * 4 + 2], SEQ: [0], QIDX: [0], LORA: [3], LOGITS: [0]},
        [[5, 2]],
    ),
    "decode batch, tables of unequal length padded with block 0": (
        [SeqWork([1], 0, [6], 1), SeqWork([2], 9, [1, 2, 3], 2), SeqWork([3], 4, [7, 5], ZERO)],
        {IDS: [1, 2, 3], POS: [0, 9, 4], KV_SLOT: [24, 13, 20], SEQ: [0, 1, 2], QIDX: [0, 0, 0], LORA: [1, 2, 8],
         LOGITS: [0, 1, 2]},
        [[6, 0, 0], [1, 2, 3], [7, 5, 0]],
    ),
    "prefill over three blocks, last token's logits only": (
        [SeqWork(list(range(10, 20)), 0, [9, 4, 6], 0)],
        {IDS: list(range(10, 20)), POS: list(range(10)), KV_SLOT: [36, 37, 38, 39, 16, 17, 18, 19, 24, 25],
         SEQ: [0] * 10, QIDX: list(range(10)), LORA: [0] * 10, LOGITS: [9]},
        [[9, 4, 6]],
    ),
    "two verifies, every query token's logits": (
        [SeqWork([1, 2, 3], 2, [0, 1], 4, num_logits=3), SeqWork([4, 5], 6, [2, 3], 5, num_logits=2)],
        {IDS: [1, 2, 3, 4, 5], POS: [2, 3, 4, 6, 7], KV_SLOT: [2, 3, 4, 14, 15], SEQ: [0, 0, 0, 1, 1],
         QIDX: [0, 1, 2, 0, 1], LORA: [4, 4, 4, 5, 5], LOGITS: [0, 1, 2, 3, 4]},
        [[0, 1], [2, 3]],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_pack_forward(name):
    work, expected, expected_tables = CASES[name]
    num_tokens, num_logits = len(expected[IDS]), len(expected[LOGITS])
    rows = np.full((NUM_ROWS, num_tokens), -1, dtype=np.int64)
    tables = np.full((len(work), len(expected_tables[0])), -1, dtype=np.int64)
    assert pack_forward(work, BLOCK, ZERO, rows, tables) == (num_tokens, num_logits)
    for row, values in expected.items():
        assert rows[row, : len(values)].tolist() == values, row
    assert tables.tolist() == expected_tables


@pytest.mark.parametrize("name", list(CASES))
def test_eager_batch_holds_the_packed_rows(name):
    work, expected, expected_tables = CASES[name]
    b = build_forward_batch(work, BLOCK, ZERO, torch.device("cpu"))
    got = {IDS: b.input_ids, POS: b.attn.positions, KV_SLOT: b.attn.slot_mapping, SEQ: b.attn.token_seq,
           QIDX: b.attn.token_qidx, LORA: b.lora_slots, LOGITS: b.logits_indices}
    assert {row: t.tolist() for row, t in got.items()} == expected
    assert all(t.dtype == torch.long for t in got.values())
    assert b.attn.block_tables.tolist() == expected_tables
    assert b.attn.max_query_len == max(len(w.token_ids) for w in work)
    assert b.has_lora == any(w.lora_slot != ZERO for w in work)


def test_base_only_batch_skips_lora():
    work = [SeqWork(token_ids=[1], start=0, block_table=[0], lora_slot=2)]
    assert not build_forward_batch(work, 16, zero_slot=2, device=torch.device("cpu")).has_lora


def test_sources_take_ids_and_shift_positions_on_the_device():
    """Token 1 takes its id from the device tensor, token 3 too; sequence 1 (tokens 2-3) is moved by shifts[1] = 2
    positions, across its block boundary, and its KV slots follow its block table; the others stay."""
    work = [SeqWork([5, 0], 2, [3, 1], lora_slot=0),
            SeqWork([0, 0], 2, [6, 2], lora_slot=0, num_logits=2, shift=1, shift_max=2)]
    rows = np.full((BUFFER_ROWS, 4), -1, dtype=np.int64)
    tables = np.full((2, 2), -1, dtype=np.int64)
    pack_forward(work, BLOCK, ZERO, rows, tables, token_src=[-1, 0, 2, 1])
    assert rows[SHIFT_SRC].tolist() == [-1, -1, 1, 1] and rows[TOKEN_SRC].tolist() == [-1, 0, 2, 1]
    packed, tabs = torch.from_numpy(rows), torch.from_numpy(tables)
    apply_sources(packed, tabs, BLOCK, tokens=torch.tensor([11, 12, 13]), shifts=torch.tensor([0, 2]))
    assert packed[IDS].tolist() == [5, 11, 13, 12]
    assert packed[POS].tolist() == [2, 3, 4, 5]
    assert packed[KV_SLOT].tolist() == [3 * 4 + 2, 3 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1]


def test_sources_leave_the_columns_past_the_slice_and_the_unmoved_tokens_alone():
    """A graph applies the sources to rows[:, :bucket] of its wider static rows: only shifts here (ids stay), token 0
    unmoved (its position and slot stay even where they disagree with its table), token 1 moved by shifts[0] = 3."""
    rows = torch.tensor([[7, 8, 9], [5, 2, 6], [99, 98, 97], [0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 5],
                         [-1, 0, 0]])  # [BUFFER_ROWS, 3]: column 2 past the slice
    apply_sources(rows[:, :2], torch.tensor([[4, 1]]), BLOCK, tokens=None, shifts=torch.tensor([3]))
    assert rows[IDS].tolist() == [7, 8, 9]
    assert rows[POS].tolist() == [5, 5, 6] and rows[KV_SLOT].tolist() == [99, 1 * 4 + 1, 97]


def test_advance_forward_moves_a_forward_one_position_on():
    """Each sequence's token at its next position, its id from tokens[start + t], its KV slot from its table (token 0
    crosses into its second block)."""
    ids, positions, kv_slots, seq = (torch.tensor(v) for v in ([1, 2], [3, 6], [-1, -1], [1, 0]))
    advance_forward(ids, positions, kv_slots, seq, torch.tensor([[3, 6], [2, 5]]), BLOCK, torch.arange(10, 20), 4)
    assert ids.tolist() == [14, 15] and positions.tolist() == [4, 7]
    assert kv_slots.tolist() == [5 * 4 + 0, 6 * 4 + 3]


def test_an_eager_batch_applies_its_sources_with_the_ops_it_is_given():
    calls = []
    ops = MetadataOps(apply_sources=lambda rows, *a: calls.append(rows.shape) or apply_sources(rows, *a))
    work = [SeqWork([0], 2, [3], lora_slot=0, shift=0, shift_max=1)]
    b = build_forward_batch(work, BLOCK, ZERO, torch.device("cpu"), token_src=[0], tokens=torch.tensor([42]),
                            shifts=torch.tensor([1]), metadata=ops)
    assert calls == [(BUFFER_ROWS, 1)]
    assert b.input_ids.tolist() == [42] and b.attn.positions.tolist() == [3] and b.attn.slot_mapping.tolist() == [15]


def test_sources_need_the_buffer_rows():
    with pytest.raises(ValueError, match="BUFFER_ROWS"):
        pack_forward([SeqWork([1], 0, [0], 0)], BLOCK, ZERO, np.zeros((NUM_ROWS, 1), np.int64),
                     np.zeros((1, 1), np.int64), token_src=[0])


def test_block_tables_packed_from_the_mirror_equal_the_tables_themselves():
    """Tables the block manager keeps (BlockTable) are packed from its mirror's rows; through random growth,
    truncation (speculative rollback, then other blocks), frees, shares and cache hits, every pack equals the pack
    of the same tables as plain lists, eager (as wide as the longest) and padded for a graph, where a row held a
    longer table before."""
    import pickle
    import random

    from engine_ext.block_manager import BlockManager, BlockTable

    rng = random.Random(3)
    bm = BlockManager(400, BLOCK)
    tables = [BlockTable() for _ in range(12)]
    for round_ in range(60):
        for t in tables:
            op = rng.random()
            if op < 0.5:
                bm.allocate(t, len(t) * BLOCK + rng.randint(1, 3 * BLOCK))
            elif op < 0.75 and t:
                bm.truncate(t, rng.randint(0, len(t) * BLOCK))
            elif op < 0.85:
                bm.free(t)
            elif op < 0.95 and not t:
                source = max(tables, key=len)
                if source is not t and source:
                    bm.share(source, rng.randint(1, len(source)), t)
            if len(t) * BLOCK > 40 * BLOCK:
                bm.free(t)  # keep within the free list
        if round_ % 7 == 0:  # a cached chain taken as a new table's start
            donor = next((t for t in tables if t), None)
            taker = next((t for t in tables if not t), None)
            if donor is not None and taker is not None:
                for i, block in enumerate(donor):
                    bm.register(block, bytes([round_, i]), b"root")
                bm.take(bm.lookup([bytes([round_, i]) for i in range(len(donor))]), taker)
        live = [t for t in tables if t]
        if not live:
            continue
        rng.shuffle(live)
        mirrored = [SeqWork([1], 0, t, 0) for t in live]
        plain = [SeqWork([1], 0, list(t), 0) for t in live]
        for pad_to, width in ((None, max(map(len, live))), (64, 48)):
            got, want = (np.full((len(live) + 1, width), -5, np.int64) for _ in range(2))
            rows = np.empty((BUFFER_ROWS, 64), np.int64)
            pack_forward(mirrored, BLOCK, ZERO, rows, got, pad_to=pad_to, pad_block=7)
            pack_forward(plain, BLOCK, ZERO, rows, want, pad_to=pad_to, pad_block=7)
            assert (got == want).all(), round_
    assert bm.mirror.array.shape[0] >= 12
    assert type(pickle.loads(pickle.dumps(tables[0]))) is list  # to a tensor-parallel worker: the ids alone
