"""Verification of drafted tokens against the target (adapter-on) model: pure functions."""

from __future__ import annotations

import torch

from ..sampler import draw


def acceptance_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Accept a drafted token d with probability min(1, p(d) / q(d))."""
    return torch.clamp(p / q, max=1.0)


def verify_drafts(p: torch.Tensor, q: torch.Tensor | None, drafts: list[int],
                  generator: torch.Generator | None, default: torch.Generator) -> list[int]:
    """Tokens to commit: the accepted prefix of `drafts` plus one token from the target.

    p: [m+1, V] target distributions after last, d1..dm (greedy: target logits); q: [m, V] draft
    distributions (None: greedy). Greedy accepts while d_i == argmax p_i. Sampling accepts d_i with
    probability min(1, p_i(d_i) / q_i(d_i)); on the first rejection it draws from
    normalize(max(0, p_i - q_i)), so every committed token is distributed exactly as under p."""
    if q is None:
        return accept_greedy(drafts, p.argmax(dim=-1).tolist())
    gen = generator or default
    u = torch.rand(len(drafts), generator=gen, device=p.device)
    for i, d in enumerate(drafts):
        if u[i] >= acceptance_probability(p[i, d], q[i, d]):
            residual = torch.clamp(p[i] - q[i], min=0.0)
            residual = residual if residual.sum() > 0 else p[i]
            token = draw((residual / residual.sum())[None], [generator], default)
            return drafts[:i] + [int(token)]
    return drafts + [int(draw(p[len(drafts)][None], [generator], default))]


def accept_greedy(drafts: list[int], target: list[int]) -> list[int]:
    """target[i] = argmax of the target after last, d1..di: keep drafts while they agree, then the target's own."""
    n = 0
    while n < len(drafts) and drafts[n] == target[n]:
        n += 1
    return drafts[:n] + [target[n]]
