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


def commit_rows(buf: torch.Tensor, lanes: torch.Tensor, shifts: bool):
    """What each row of a cycle commits, on the device: buf [N] the step's token buffer; lanes [5, R, W] the plan's
    index lanes into it (executor._Layout: commit order, drafts, the targets they are compared with, and the fixed
    and verified counts in column 0; -1 pads). Returns (out [R, W + 1]: the row's tokens in commit order, then how
    many it commits: its fixed tokens, then the verify pass's up to and including the first that differs from its
    draft; last [R]: its last committed token; shift [R] (with `shifts`) or None: the drafts it accepted, which it
    commits beyond what the step assumed). kernels/triton_verify.py does the same in one launch."""
    order, draft, target, fixed, verified = lanes
    tokens = buf[order.clamp_min(0)]
    accepted = accepted_lengths(buf[draft.clamp_min(0)], buf[target.clamp_min(0)], draft >= 0)
    verifies = verified[:, 0] > 0
    counts = fixed[:, 0] + verifies * (accepted + 1)
    last = tokens.gather(1, (counts - 1).clamp_min(0)[:, None])[:, 0]
    return torch.cat([tokens, counts[:, None]], dim=1), last, verifies * accepted if shifts else None
