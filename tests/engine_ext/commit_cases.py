"""Random commit lanes (executor._Layout's table) for checking kernels/triton_verify.py against
speculation/verify.commit_rows: rows with and without drafts, drafts that match their targets for a random number
of leading positions, rows that do not verify, and widths from 1 to past a power of two."""

from __future__ import annotations

import numpy as np
import torch

from engine_ext.speculation import verify


def commit_case(rng: np.random.Generator, rows: int, width: int, buf_len: int = 512):
    """(buf [buf_len] long, lanes [5, rows, width] long) of one random cycle."""
    buf = rng.integers(0, 50, buf_len)
    lanes = np.full((5, rows, width), -1, dtype=np.int64)
    for r in range(rows):
        k = int(rng.integers(0, width))  # drafts (< width: a row commits its fixed tokens and k + 1 verified)
        fixed = int(rng.integers(0, width - k))
        verifies = bool(rng.integers(0, 4)) or fixed == 0  # most rows verify; one with nothing fixed always does
        n = fixed + (k + 1 if verifies else 0)
        lanes[0, r, :n] = rng.choice(buf_len, n, replace=False)
        draft = rng.choice(buf_len, k, replace=False)
        target = rng.choice(buf_len, k, replace=False)
        agree = int(rng.integers(0, k + 1))  # its first `agree` drafts equal their targets
        buf[target[:agree]] = buf[draft[:agree]]
        lanes[1, r, :k], lanes[2, r, :k] = draft, target
        lanes[3, r, 0], lanes[4, r, 0] = fixed, k + 1 if verifies else 0
    return torch.from_numpy(buf), torch.from_numpy(lanes)


def check_commit_kernel(commit, device) -> int:
    """Compare `commit` (commit_rows_triton's signature) with the reference on many random cases; returns how many
    rows accepted at least one draft (a check that the cases exercise acceptance)."""
    rng = np.random.default_rng(0)
    accepted = 0
    for rows, width in [(1, 1), (3, 2), (8, 5), (33, 9), (128, 17), (5, 32)]:
        for _ in range(4):
            buf, lanes = (t.to(device) for t in commit_case(rng, rows, width))
            for shifts in (True, False):
                out, last, shift = commit(buf, lanes.contiguous(), shifts)
                ref_out, ref_last, ref_shift = verify.commit_rows(buf, lanes, shifts)
                counts = ref_out[:, -1]
                for r in range(rows):  # tokens past a row's count are never read
                    c = int(counts[r])
                    assert torch.equal(out[r, :c], ref_out[r, :c]), (rows, width, r)
                assert torch.equal(out[:, -1], counts) and torch.equal(last, ref_last)
                if shifts:
                    assert torch.equal(shift, ref_shift)
                    accepted += int((ref_shift > 0).sum())
                else:
                    assert shift is None
    return accepted
