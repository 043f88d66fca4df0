"""The CUDA-graph packing (pack_forward padded to a bucket) equals the eager one, plus inert padding; and the debug
bounds checks of work items and packed rows (runs on the CPU)."""

import numpy as np
import pytest
import torch

from engine_ext.batch import (IDS, KV_SLOT, LOGITS, LORA, NUM_ROWS, POS, QIDX, SEQ, ForwardInputError, ForwardLimits,
                              SeqWork, build_forward_batch, check_packed, check_work, pack_forward)
from engine_ext.cuda_graphs import graph_buckets

BLOCK, ZERO, SCRATCH = 4, 9, 99
LIMITS = ForwardLimits(vocab_size=64, max_positions=40, num_blocks=SCRATCH, block_size=BLOCK, num_slots=ZERO + 1)


def pack_padded(work, bucket, rows, tables):
    return pack_forward(work, BLOCK, ZERO, rows, tables, pad_to=bucket, pad_block=SCRATCH)


def check_padded(rows, tables, num_seqs, t, n, bucket):
    check_packed(rows, tables, num_seqs, t, n, LIMITS, pad_to=bucket, pad_block=SCRATCH)


def _work():
    return [
        SeqWork([5], 6, [3, 1], lora_slot=2),  # decode
        SeqWork([7, 8, 9, 10], 9, [4, 0, 6, 2], lora_slot=ZERO, num_logits=4),  # verify, 3 drafts
        SeqWork([11, 12], 0, [8], lora_slot=0, num_logits=1),  # short prefill
    ]


@pytest.mark.parametrize("bucket", [7, 8, 16])
def test_packed_rows_match_the_eager_batch_then_pad(bucket):
    work = _work()
    ref = build_forward_batch(work, BLOCK, ZERO, torch.device("cpu"))
    rows = np.full((NUM_ROWS + 2, 16), -1, dtype=np.int64)  # the graph's buffer has two more rows
    tables = np.full((17, 5), -1, dtype=np.int64)
    t, n = pack_padded(work, bucket, rows, tables)
    assert (t, n) == (7, 6)
    expected = {IDS: ref.input_ids, POS: ref.attn.positions, KV_SLOT: ref.attn.slot_mapping, SEQ: ref.attn.token_seq,
                QIDX: ref.attn.token_qidx, LORA: ref.lora_slots}
    for row, exp in expected.items():
        assert rows[row, :t].tolist() == exp.tolist()
    assert rows[LOGITS, :n].tolist() == ref.logits_indices.tolist()
    for i, w in enumerate(work):
        assert tables[i, : len(w.block_table)].tolist() == w.block_table
    pad = slice(t, bucket)
    assert (rows[IDS, pad] == 0).all() and (rows[POS, pad] == 0).all()
    assert rows[QIDX, pad].tolist() == list(range(bucket - t))  # one more sequence's query tokens
    assert (rows[KV_SLOT, pad] == SCRATCH * BLOCK).all()  # padding writes only the scratch block
    assert (rows[SEQ, pad] == len(work)).all() and (tables[len(work)] == SCRATCH).all()
    assert (rows[LORA, pad] == ZERO).all()  # and uses no adapter
    assert (rows[LOGITS, n:bucket] == 0).all()
    assert (rows[:NUM_ROWS, bucket:] == -1).all()  # nothing a `bucket`-token graph does not read


def test_too_many_tokens_for_the_bucket_is_refused():
    with pytest.raises(ValueError, match="do not fit"):
        pack_padded(_work(), 6, np.zeros((NUM_ROWS, 16), np.int64), np.zeros((17, 5), np.int64))


@pytest.mark.parametrize("max_tokens", [1, 5, 16, 100, 640])
def test_buckets_cover_every_count_with_bounded_padding(max_tokens):
    buckets = graph_buckets(max_tokens)
    assert buckets == sorted(set(buckets)) and buckets[-1] == max_tokens
    for t in range(1, max_tokens + 1):
        b = next(b for b in buckets if b >= t)
        assert b - t <= max(1, t // 3 + 16 if t > 16 else t)


def test_reused_buffers_keep_nothing_from_an_earlier_batch():
    """The packing buffers are reused forward after forward: a prefill batch's logits rows (large token indices)
    must not survive into a smaller batch's graph, whose final norm gathers every one of its `bucket` rows."""
    rows = np.zeros((NUM_ROWS + 2, 64), dtype=np.int64)
    tables = np.zeros((65, 10), dtype=np.int64)
    big = [SeqWork(list(range(1, 21)), 0, [1, 2, 3, 4, 5], 0), SeqWork(list(range(1, 31)), 0, list(range(6, 14)), 1)]
    pack_padded(big, 64, rows, tables)
    assert rows[LOGITS, :2].tolist() == [19, 49]
    small = [SeqWork(list(range(1, 9)), 0, [20, 21], 2)]  # a prefill: 8 tokens, one logits row
    t, n = pack_padded(small, 8, rows, tables)
    assert (t, n) == (8, 1)
    assert rows[LOGITS, :8].max() < 8  # a 49 left in row 1 would gather past the end of the bucket
    assert tables[0].tolist() == [20, 21] + [SCRATCH] * 8 and tables[1].tolist() == [SCRATCH] * 10
    check_padded(rows, tables, 1, t, n, 8)


@pytest.mark.parametrize("corrupt, message", [
    (lambda r, tb: r.__setitem__((LOGITS, 3), 9), "logits rows"),
    (lambda r, tb: r.__setitem__((LOGITS, 0), 7), "logits rows"),
    (lambda r, tb: r.__setitem__((LORA, 2), ZERO + 1), "adapter slots"),
    (lambda r, tb: r.__setitem__((POS, 0), 40), "positions"),
    (lambda r, tb: r.__setitem__((IDS, 1), 64), "token ids"),
    (lambda r, tb: r.__setitem__((KV_SLOT, 6), (SCRATCH + 1) * BLOCK), "KV slots"),
    (lambda r, tb: r.__setitem__((QIDX, 5), 8), "query indices"),
    (lambda r, tb: tb.__setitem__((0, 1), SCRATCH + 1), "block tables"),
    (lambda r, tb: r.__setitem__((SEQ, 7), 2), "sequence indices"),
])
def test_packed_bounds_check_names_what_would_be_read_out_of_bounds(corrupt, message):
    rows = np.zeros((NUM_ROWS + 2, 16), dtype=np.int64)
    tables = np.zeros((17, 10), dtype=np.int64)
    work = [SeqWork([5, 6, 7], 4, [3, 1], 2)]
    t, n = pack_padded(work, 8, rows, tables)
    check_padded(rows, tables, 1, t, n, 8)
    corrupt(rows, tables)
    with pytest.raises(ForwardInputError, match=message):
        check_padded(rows, tables, 1, t, n, 8)


@pytest.mark.parametrize("corrupt, message", [
    (lambda r, tb: r.__setitem__((LOGITS, 0), 3), "logits rows"),
    (lambda r, tb: r.__setitem__((KV_SLOT, 1), SCRATCH * BLOCK), "KV slots"),  # no scratch block unpadded
    (lambda r, tb: tb.__setitem__((1, 0), SCRATCH), "block tables"),
    (lambda r, tb: r.__setitem__((SEQ, 2), 2), "sequence indices"),
    (lambda r, tb: r.__setitem__((QIDX, 0), 3), "query indices"),
])
def test_unpadded_bounds_check(corrupt, message):
    """The eager forward's packing (no padding) is held to the real blocks and sequences."""
    rows = np.zeros((NUM_ROWS, 3), dtype=np.int64)
    tables = np.zeros((2, 2), dtype=np.int64)
    t, n = pack_forward([SeqWork([5, 6], 4, [3, 1], 2), SeqWork([7], 0, [SCRATCH - 1], ZERO)], BLOCK, ZERO, rows,
                        tables)
    check_packed(rows, tables, 2, t, n, LIMITS)
    corrupt(rows, tables)
    with pytest.raises(ForwardInputError, match=message):
        check_packed(rows, tables, 2, t, n, LIMITS)


@pytest.mark.parametrize("work, token_src, message", [
    ([SeqWork([1, 2], 0, [0], 0, num_logits=3)], None, "num_logits"),
    ([SeqWork([1, 2], 39, [0] * 10, 0)], None, "positions up to 40"),
    ([SeqWork([64], 0, [0], 0)], None, "token id"),
    ([SeqWork([1], 4, [0], 0)], None, "do not cover position 4"),
    ([SeqWork([1], 0, [SCRATCH], 0)], None, "block id"),
    ([SeqWork([1], 0, [0], ZERO + 1)], None, "adapter slot"),
    ([SeqWork([1, 2], 0, [0], 0)], [0, 5], "token_src reads up to 5"),
    ([SeqWork([1, 2], 0, [0], 0)], [0], "entries for 2 tokens"),
])
def test_work_bounds_check(work, token_src, message):
    with pytest.raises(ForwardInputError, match=message):
        check_work(work, LIMITS, 5, token_src)


def test_work_within_bounds_passes():
    check_work([SeqWork([1, 2, 63], 37, [0] * 10, ZERO, num_logits=3), SeqWork([9], 0, [SCRATCH - 1], 0)], LIMITS,
               4, [-1, 3, -1, 0])
