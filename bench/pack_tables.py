"""A 128-row forward's packing (batch.pack_forward, padded as for a CUDA graph) on the host, with each sequence's
block table `--widths` blocks long: tables given as Python lists (copied id by id) against the block manager's
BlockTables (gathered from its mirror's rows). Rounds alternate the two; prints the minimum per round of each, in
microseconds, as one JSON object.

    python bench/pack_tables.py [--widths 2 20 64 256 512] [--rounds 15]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[2, 20, 64, 256, 512])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--packs", type=int, default=300, help="packs timed per round")
    args = ap.parse_args()

    import numpy as np

    from engine_ext.batch import BUFFER_ROWS, SeqWork, pack_forward
    from engine_ext.block_manager import BlockManager, BlockTable

    block, bucket, width_max = 16, 2 * args.batch, max(args.widths) + 8
    out = {"batch": args.batch, "rounds": args.rounds, "us_per_pack": {}}
    for width in args.widths:
        blocks = BlockManager(args.batch * width + 64, block)
        tables = [BlockTable() for _ in range(args.batch)]
        for t in tables:
            blocks.allocate(t, width * block)
        kinds = {"lists": [SeqWork([5], 3 * i + 7, list(t), i % 8) for i, t in enumerate(tables)],
                 "mirror": [SeqWork([5], 3 * i + 7, t, i % 8) for i, t in enumerate(tables)]}
        rows, packed = np.empty((BUFFER_ROWS, bucket), np.int64), np.empty((args.batch + 1, width_max), np.int64)
        best = {k: float("inf") for k in kinds}
        for _ in range(args.rounds):
            for kind, work in kinds.items():
                start = time.perf_counter()
                for _ in range(args.packs):
                    pack_forward(work, block, 8, rows, packed, pad_to=bucket, pad_block=0)
                best[kind] = min(best[kind], (time.perf_counter() - start) / args.packs * 1e6)
        out["us_per_pack"][str(width)] = {k: round(v, 1) for k, v in best.items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
