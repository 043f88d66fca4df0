"""Per-adapter acceptance: the chance a and the tokens a cycle yields at a."""

from __future__ import annotations

import math


def expected_tokens(acceptance: float, m: int) -> float:
    """E(a, m) = (1 - a^(m+1)) / (1 - a): the accepted run of m drafts plus the target's own token."""
    if acceptance >= 1.0:
        return m + 1.0
    return (1.0 - acceptance ** (m + 1)) / (1.0 - acceptance)


def useful_drafts(acceptance: float, worth: float) -> int:
    """The most drafts j with acceptance^j >= worth: the j-th draft's expected tokens against its cost."""
    if worth <= 0.0 or acceptance >= 1.0:
        return 1 << 30
    if acceptance <= 0.0 or worth >= 1.0:
        return 0
    return int(math.log(worth) / math.log(acceptance) + 1e-9)


class AdapterAcceptance:
    """Running estimate of per-token acceptance a: the chance a draft is accepted given the drafts before it were.
    Drafts after the first rejection are never judged, so a is accepted over judged drafts (accepted plus one
    per rejection), not over drafted ones, which would fall with the draft length for the same adapter.

    Both counts decay by `weight` per verify, so every judged draft weighs alike and the estimate follows an
    adapter whose drafts drift. The prior counts as PRIOR_DRAFTS judged drafts: a new adapter's estimate is
    its own within a few verifies."""

    PRIOR_DRAFTS = 1.0

    def __init__(self, ema: float):
        self.ema = ema
        self.idle_steps = 0  # plain steps since it last drafted (a gated-off adapter is re-measured after a while)

    @property
    def ema(self) -> float:
        return self.accepted_weight / self.judged_weight

    @ema.setter
    def ema(self, value: float) -> None:  # a prior (or a test's state): PRIOR_DRAFTS judged drafts at this rate
        self.accepted_weight, self.judged_weight = value * self.PRIOR_DRAFTS, self.PRIOR_DRAFTS

    def observe(self, drafted: int, accepted: int, weight: float) -> None:
        judged = accepted + (accepted < drafted)
        self.idle_steps = 0
        if judged:
            keep = 1.0 - weight
            self.accepted_weight = keep * self.accepted_weight + accepted
            self.judged_weight = keep * self.judged_weight + judged
