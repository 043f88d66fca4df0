"""Sweep the Triton paged attention's launch settings at the 1B shape (32 query heads, 8 KV heads,
head_dim 64, page 16): decode batch 8, 32 and 128 and a k=4 verify pass (32 x 5 tokens), context 512; each
setting (engine_ext.KernelSettings' attn_* fields) timed as a CUDA graph of 16 calls (one per layer). Prints JSON
rows and the best setting."""

import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import graph_ms  # noqa: E402
from engine_ext.attention import AttnMetadata  # noqa: E402
from engine_ext.kernels import KernelSettings  # noqa: E402
from engine_ext.kernels.triton_attention import paged_attention_triton  # noqa: E402


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


def time_it(q, caches, meta, settings):
    """16 calls (one per layer) in one CUDA graph."""
    return graph_ms(lambda: [paged_attention_triton(q, caches[0], caches[1], meta, 0.125, settings=settings)
                             for _ in range(16)])


def settings():
    """(splits, block_n, warps, stages, rows): Triton's pipelining at 1-4 stages, 16- or 32-row tiles, and a
    few split-KV points."""
    for block_n, warps, stages, rows in itertools.product((64, 128), (4, 8), (0, 1, 2, 4), (0, 16)):
        yield 1, block_n, warps, stages, rows
    for splits, block_n in itertools.product((2, 4), (64, 128)):
        yield splits, block_n, 4, 0, 16


def main():
    cases = {"decode32": case(32, 1), "verify32x5": case(32, 5), "decode128": case(128, 1), "decode8": case(8, 1)}
    rows = []
    for splits, block_n, warps, stages, tile_rows in settings():
        settings = KernelSettings(attn_max_splits=splits, attn_block_n=block_n, attn_warps=warps,
                                  attn_split_budget=1 << 20, attn_stages=stages, attn_rows=tile_rows)
        row = {"splits": splits, "block_n": block_n, "warps": warps, "stages": stages, "rows": tile_rows}
        try:
            for name, (q, caches, meta) in cases.items():
                row[name + "_ms16"] = time_it(q, caches, meta, settings)
        except Exception as e:  # e.g. out of shared memory at a large tile and many stages
            row["error"] = str(e)[:200]
            torch.cuda.synchronize()
        rows.append(row)
        print(json.dumps(row), flush=True)
    for name in cases:
        best = min((r for r in rows if "error" not in r), key=lambda r: r[name + "_ms16"])
        print("BEST", name, json.dumps(best))


if __name__ == "__main__":
    main()
