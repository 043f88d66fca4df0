"""Random packed forwards on which a forward's metadata fix-ups must equal their torch references exactly
(batch.apply_sources, batch.advance_forward): the Triton kernels on a GPU (gpu/test_triton_metadata.py) and under
Triton's interpreter on the CPU (interpreted_checks.py metadata)."""

from __future__ import annotations

import torch

from engine_ext.batch import BUFFER_ROWS, IDS, KV_SLOT, POS, SEQ, SHIFT_SRC, TOKEN_SRC, advance_forward, apply_sources

BLOCK, WIDTH, SEQS = 4, 6, 5  # block size, blocks per sequence, sequences (a row of the tables each, and a pad row)
MAX_SHIFT = 3
# apply_sources: (tokens, shifts) given
SOURCES = {"tokens and shifts": (True, True), "tokens only": (True, False), "shifts only": (False, True),
           "neither": (False, False)}
# (tokens in the forward, columns of the buffer past them: a graph's rows[:, :bucket] of its wider static rows)
SIZES = [(1, 0), (7, 9), (128, 0), (300, 45)]


def _packed(g: torch.Generator, num_tokens: int, extra: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random rows [BUFFER_ROWS, T + extra] (every row random, sources -1 about a third of the time) and tables
    [SEQS + 1, WIDTH] of block ids, positions low enough for any shift and one more step to stay in the table."""
    cols = num_tokens + extra
    rows = torch.randint(0, 1000, (BUFFER_ROWS, cols), generator=g)
    rows[SEQ] = torch.randint(0, SEQS + 1, (cols,), generator=g)
    rows[POS] = torch.randint(0, WIDTH * BLOCK - MAX_SHIFT - 1, (cols,), generator=g)
    for row, high in ((TOKEN_SRC, 40), (SHIFT_SRC, SEQS)):
        src = torch.randint(0, high, (cols,), generator=g)
        rows[row] = torch.where(torch.rand(cols, generator=g) < 0.35, -1, src)
    return rows, torch.randint(0, 500, (SEQS + 1, WIDTH), generator=g)


def check_apply_sources(op, device: str) -> int:
    """op (apply_sources' signature) against the reference on every SOURCES x SIZES case, on `device`; the
    buffer's columns past the slice and every row it does not write stay as they were. Returns the cases run."""
    g = torch.Generator().manual_seed(0)
    cases = 0
    for name, (with_tokens, with_shifts) in SOURCES.items():
        for num_tokens, extra in SIZES:
            rows, tables = _packed(g, num_tokens, extra)
            # tokens a strided view (every other entry of a longer buffer): the kernel reads any stride
            tokens = torch.randint(0, 50000, (80,), generator=g)[1::2] if with_tokens else None
            shifts = torch.randint(0, MAX_SHIFT + 1, (SEQS,), generator=g) if with_shifts else None
            moved = [None if t is None else t.to(device) for t in (rows, tables, tokens, shifts)]
            ref = rows.clone()
            apply_sources(ref[:, :num_tokens], tables, BLOCK, tokens, shifts)
            op(moved[0][:, :num_tokens], *moved[1:2], BLOCK, *moved[2:])
            got = moved[0].cpu()
            assert torch.equal(got, ref), (name, num_tokens, (got != ref).nonzero()[:8].tolist())
            assert torch.equal(moved[1].cpu(), tables)
            cases += 1
    return cases


def check_advance_forward(op, device: str) -> int:
    """op (advance_forward's signature) against the reference: the four as rows of one packed buffer (a graph's,
    the first n of its columns) and as tensors of their own, from token `start` 0 and later. Returns the cases
    run."""
    g = torch.Generator().manual_seed(1)
    cases = 0
    for num_tokens, extra in SIZES:
        for start in (0, 5):
            for separate in (False, True):
                rows, tables = _packed(g, num_tokens, extra)
                tokens = torch.randint(0, 50000, (start + num_tokens + 3,), generator=g)
                ref = rows.clone()
                advance_forward(*(ref[r, :num_tokens] for r in (IDS, POS, KV_SLOT, SEQ)), tables, BLOCK, tokens,
                                start)
                dev = rows.to(device)
                views = [dev[r, :num_tokens] for r in (IDS, POS, KV_SLOT, SEQ)]
                if separate:  # an eager forward's rows, each its own tensor
                    views = [v.clone() for v in views]
                op(*views, tables.to(device), BLOCK, tokens.to(device), start)
                if separate:
                    for r, v in zip((IDS, POS, KV_SLOT, SEQ), views):
                        dev[r, :num_tokens] = v
                got = dev.cpu()
                assert torch.equal(got, ref), (num_tokens, start, separate, (got != ref).nonzero()[:8].tolist())
                cases += 1
    return cases


def check_advance_refuses_short_tokens(op, device: str) -> None:
    """A forward reading past the token buffer is refused on the host, as the reference's copy refuses it."""
    rows, tables = _packed(torch.Generator().manual_seed(2), 4, 0)
    rows, tables = rows.to(device), tables.to(device)
    tokens = torch.zeros(6, dtype=torch.long, device=device)
    try:
        op(rows[IDS], rows[POS], rows[KV_SLOT], rows[SEQ], tables, BLOCK, tokens, 3)
    except (ValueError, RuntimeError):
        return
    raise AssertionError("tokens[3:7] of a 6-token buffer was not refused")
