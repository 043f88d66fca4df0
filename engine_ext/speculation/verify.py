"""Verification of drafted tokens against the target (adapter-on) model.

Every token is drawn by Gumbel-max with noise keyed by (the request's seed, the token's position) (sampler.py):
the draft d_i at position p is argmax(draft logits / T + g_p), the target's token t_i there argmax(target logits /
T + g_p) with the same g_p. A cycle commits the target's tokens t_1.. up to and including the first t_i != d_i:
each t_i is exactly the token plain decoding draws at p (the same logits, the same noise), so the output is plain
decoding's token for token, greedy (T = 0: no noise) and sampled alike, and a draft is accepted exactly when it is
the token plain decoding would have drawn. (The chance of that is P(argmax(log q + g) = argmax(log p + g)), a little
below rejection sampling's 1 - TV(p, q): bench/RESULTS.md has the measured difference.)"""

from __future__ import annotations

import torch


def accepted_lengths(drafts: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[R, K] drafts, the target tokens drawn at the same positions, and which entries are drafts -> [R] the number
    of leading drafts equal to their target (on the device)."""
    return ((drafts == targets) & valid).long().cumprod(dim=1).sum(dim=1)
