"""Sweep the Triton paged attention's launch settings at the 1B shape (32 query heads, 8 KV heads,
head_dim 64, page 16): decode batch 32 and a k=4 verify pass (32 x 5 tokens), context 512; each
setting timed as a CUDA graph of 16 calls (one per layer). Prints JSON rows and the best setting."""

import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import graph_ms  # noqa: E402
from engine_ext.attention import AttnMetadata  # noqa: E402
from engine_ext.kernels import triton_attention as ta  # noqa: E402


def case(seqs, per_seq, ctx=512, page=16, heads=32, kvh=8, d=64):
    g = torch.Generator("cuda").manual_seed(0)
    nblk = -(-(ctx + per_seq) // page)
    caches = [torch.randn(seqs * nblk + 1, page, kvh, d, device="cuda", generator=g).bfloat16() for _ in range(2)]
    tables = torch.arange(seqs * nblk, device="cuda").view(seqs, nblk)
    seq = torch.arange(seqs, device="cuda").repeat_interleave(per_seq)
    qidx = torch.arange(per_seq, device="cuda").repeat(seqs)
    pos = ctx + qidx
    meta = AttnMetadata(positions=pos, slot_mapping=pos, block_tables=tables, token_seq=seq, token_qidx=qidx,
                        max_query_len=per_seq)
    q = torch.randn(seqs * per_seq, heads, d, device="cuda", generator=g).bfloat16()
    return q, caches, meta


def time_it(q, caches, meta):
    """16 calls (one per layer) in one CUDA graph."""
    return graph_ms(lambda: [ta.paged_attention_triton(q, caches[0], caches[1], meta, 0.125) for _ in range(16)])


def main():
    cases = {"decode32": case(32, 1), "verify32x5": case(32, 5)}
    rows = []
    for splits, block_n, warps, budget in itertools.product((1, 2, 4, 8), (16, 32, 64), (2, 4), (4096,)):
        ta.MAX_SPLITS, ta.BLOCK_N, ta.NUM_WARPS, ta.SPLIT_BUDGET = splits, block_n, warps, 1 << 20
        row = {"splits": splits, "block_n": block_n, "warps": warps}
        for name, (q, caches, meta) in cases.items():
            row[name + "_ms16"] = time_it(q, caches, meta)
        rows.append(row)
        print(json.dumps(row), flush=True)
    for name in cases:
        best = min(rows, key=lambda r: r[name + "_ms16"])
        print("BEST", name, json.dumps(best))


if __name__ == "__main__":
    main()
