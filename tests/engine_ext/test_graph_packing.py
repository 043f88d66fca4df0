"""The packed CUDA-graph metadata equals build_forward_batch's, plus inert padding (runs on the CPU)."""

import numpy as np
import pytest
import torch

from engine_ext.batch import ForwardInputError, ForwardLimits, SeqWork, build_forward_batch, check_work
from engine_ext.cuda_graphs import check_packed, graph_buckets, pack_decode_batch

BLOCK, ZERO, SCRATCH = 4, 9, 99


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
    rows = np.full((7, 16), -1, dtype=np.int64)
    tables = np.full((17, 5), -1, dtype=np.int64)
    t, n = pack_decode_batch(work, BLOCK, ZERO, SCRATCH, bucket, rows, tables)
    assert (t, n) == (7, 6)
    expected = [ref.input_ids, ref.attn.positions, ref.attn.slot_mapping, ref.attn.token_seq, ref.attn.token_qidx,
                ref.lora_slots]
    for row, exp in zip(rows[:6], expected):
        assert row[:t].tolist() == exp.tolist()
    assert rows[6, :n].tolist() == ref.logits_indices.tolist()
    for i, w in enumerate(work):
        assert tables[i, : len(w.block_table)].tolist() == w.block_table
    pad = slice(t, bucket)
    assert (rows[0, pad] == 0).all() and (rows[1, pad] == 0).all()
    assert (rows[2, pad] == SCRATCH * BLOCK).all()  # padding writes only the scratch block
    assert (rows[3, pad] == len(work)).all() and tables[len(work), 0] == SCRATCH
    assert (rows[5, pad] == ZERO).all()  # and uses no adapter


def test_too_many_tokens_for_the_bucket_is_refused():
    with pytest.raises(ValueError, match="do not fit"):
        pack_decode_batch(_work(), BLOCK, ZERO, SCRATCH, 6, np.zeros((7, 16), np.int64), np.zeros((17, 5), np.int64))


@pytest.mark.parametrize("max_tokens", [1, 5, 16, 100, 640])
def test_buckets_cover_every_count_with_bounded_padding(max_tokens):
    buckets = graph_buckets(max_tokens)
    assert buckets == sorted(set(buckets)) and buckets[-1] == max_tokens
    for t in range(1, max_tokens + 1):
        b = next(b for b in buckets if b >= t)
        assert b - t <= max(1, t // 3 + 16 if t > 16 else t)


LIMITS = ForwardLimits(vocab_size=64, max_positions=40, num_blocks=SCRATCH, block_size=BLOCK, num_slots=ZERO + 1)


def test_reused_buffers_keep_nothing_from_an_earlier_batch():
    """The packing buffers are reused forward after forward: a prefill batch's logits rows (large token indices)
    must not survive into a smaller batch's graph, whose final norm gathers every one of its `bucket` rows."""
    rows = np.zeros((9, 64), dtype=np.int64)
    tables = np.zeros((65, 10), dtype=np.int64)
    big = [SeqWork(list(range(1, 21)), 0, [1, 2, 3, 4, 5], 0), SeqWork(list(range(1, 31)), 0, list(range(6, 14)), 1)]
    pack_decode_batch(big, BLOCK, ZERO, SCRATCH, 64, rows, tables)
    assert rows[6, :2].tolist() == [19, 49]
    small = [SeqWork(list(range(1, 9)), 0, [20, 21], 2)]  # a prefill: 8 tokens, one logits row
    t, n = pack_decode_batch(small, BLOCK, ZERO, SCRATCH, 8, rows, tables)
    assert (t, n) == (8, 1)
    assert rows[6, :8].max() < 8  # before the fix, row 1 still held 49: a read past the bucket
    assert tables[0].tolist() == [20, 21] + [SCRATCH] * 8 and tables[1].tolist() == [SCRATCH] * 10
    check_packed(rows, tables, 1, t, n, 8, LIMITS, SCRATCH)


@pytest.mark.parametrize("corrupt, message", [
    (lambda r, tb: r.__setitem__((6, 3), 9), "logits rows"),
    (lambda r, tb: r.__setitem__((6, 0), 7), "logits rows"),
    (lambda r, tb: r.__setitem__((5, 2), ZERO + 1), "adapter slots"),
    (lambda r, tb: r.__setitem__((1, 0), 40), "positions"),
    (lambda r, tb: r.__setitem__((0, 1), 64), "token ids"),
    (lambda r, tb: tb.__setitem__((0, 1), SCRATCH + 1), "block tables"),
    (lambda r, tb: r.__setitem__((3, 7), 2), "sequence indices"),
])
def test_packed_bounds_check_names_what_would_be_read_out_of_bounds(corrupt, message):
    rows = np.zeros((9, 16), dtype=np.int64)
    tables = np.zeros((17, 10), dtype=np.int64)
    work = [SeqWork([5, 6, 7], 4, [3, 1], 2)]
    t, n = pack_decode_batch(work, BLOCK, ZERO, SCRATCH, 8, rows, tables)
    check_packed(rows, tables, 1, t, n, 8, LIMITS, SCRATCH)
    corrupt(rows, tables)
    with pytest.raises(ForwardInputError, match=message):
        check_packed(rows, tables, 1, t, n, 8, LIMITS, SCRATCH)


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
