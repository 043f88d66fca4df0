"""The packed CUDA-graph metadata equals build_forward_batch's, plus inert padding (runs on the CPU)."""

import numpy as np
import pytest
import torch

from engine_ext.batch import SeqWork, build_forward_batch
from engine_ext.cuda_graphs import graph_buckets, pack_decode_batch

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
