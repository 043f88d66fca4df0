"""The gate's arithmetic, as pure functions of pass costs (`Costs`: estimator.Estimator) and acceptance estimates.

A cycle that drafts m tokens for a sequence whose drafts are accepted with probability a yields
E(a, m) = (1 - a^(m+1)) / (1 - a) tokens. In the overlapped loop it costs max(device, host): its device time is
M = max m base-only passes plus one adapter-on verify pass over sum(m + 1) tokens, its host time the cycle's host
work, paid once whatever its length (each with the run's gap: estimator.Estimator). A plain step gives one token per
sequence at max(plain device, plain host) + its gap.
Riders decode in every pass: M + 1 tokens a cycle."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .acceptance import useful_drafts


class Costs(Protocol):
    """Seconds of each step kind in the overlapped loop (estimator.Estimator; tests pass fixed tables)."""

    def plain(self, n: int, distinct: int, exact: bool = False) -> float | None:
        """A plain step of n sequences over `distinct` adapters (None: not measured; `exact`: at this size)."""

    def cycle(self, n: int, passes: int, tokens: int, distinct: int, riding: int) -> tuple[float, float] | None:
        """(device, host) of a cycle: `passes` drafting passes, a verify pass of `tokens` (None: unmeasured)."""

    def verify_slope(self, tokens: int, distinct: int) -> float:
        """Device seconds per verify token (0.0: unknown)."""


@dataclass(frozen=True)
class Batch:
    """The decoding batch a cycle is priced for: per adapter sequence its acceptance estimate, its longest useful
    draft (`caps`) and whether it rides; base-only sequences beside them; `slowest`: a closed batch's tokens to go
    per adapter sequence when its slowest sequence prices it (else None)."""

    accs: tuple[float, ...]
    caps: tuple[int, ...]
    ride: tuple[bool, ...]
    num_base: int
    distinct: int  # distinct adapters among the adapter sequences
    riding: int  # distinct adapters among the riding ones (the drafting passes read them)
    closed: bool = False  # nothing waits to join: the batch is done when its slowest sequence is
    slowest: tuple[int, ...] | None = None


def expected_gains(accs, lengths, ride, passes: int) -> list[float]:
    """Tokens a cycle of `passes` passes yields per adapter sequence: E(a, m), or passes + 1 for a rider. (In plain
    Python: the gate prices every step on the host, and its batches are small where host time counts.)"""
    return [passes + 1.0 if r else (m + 1.0 if a >= 1.0 else (1.0 - a ** (m + 1)) / (1.0 - a))
            for a, m, r in zip(accs, lengths, ride)]


def cycle_rate(costs: Costs, batch: Batch, lengths: list[int], slowest: bool = True) -> float | None:
    """Tokens per second of a cycle with these draft lengths (None: a pass kind never measured). With `slowest`
    and batch.slowest set: the batch's tokens over the time its slowest sequence takes at this cycle."""
    passes = max(lengths, default=0)
    parts = cycle_parts(costs, batch, lengths)
    if parts is None:
        return None
    t_cycle = max(parts)
    gains = expected_gains(batch.accs, lengths, batch.ride, passes)
    if slowest and batch.slowest:
        return sum(batch.slowest) / (max(n / g for n, g in zip(batch.slowest, gains)) * t_cycle)
    return (sum(gains) + batch.num_base * (passes + 1)) / t_cycle


def cycle_parts(costs: Costs, batch: Batch, lengths: list[int]) -> tuple[float, float] | None:
    """(device, host) seconds of a cycle with these draft lengths (None: nothing to draft, or unmeasured)."""
    passes = max(lengths, default=0)
    if not passes:
        return None
    verify = sum(lengths) + len(lengths) + batch.num_base
    return costs.cycle(len(lengths) + batch.num_base, passes, verify, batch.distinct, batch.riding)


def verify_token_cost(costs: Costs, batch: Batch, lengths: list[int]) -> float:
    """What one more verify token adds to a cycle's time: the verify pass's cost per token while the cycle is
    bound by its device time, nothing while the host's work hides it."""
    parts = cycle_parts(costs, batch, lengths)
    if parts is None or parts[0] <= parts[1]:
        return 0.0
    return costs.verify_slope(sum(lengths) + len(lengths) + batch.num_base, batch.distinct)


def lengths_for(batch: Batch, passes: int, min_acceptance: float) -> list[int]:
    """Every adapter sequence drafts `passes`, none if it rides, one if its acceptance is below min_acceptance (its
    first draft keeps its estimate current), never past its cap."""
    return [0 if r else min(1 if a < min_acceptance else passes, cap)
            for r, a, cap in zip(batch.ride, batch.accs, batch.caps)]


def best_lengths(costs: Costs, batch: Batch, k: int, min_acceptance: float) -> tuple[list[int], float | None]:
    """The draft lengths that maximise the predicted rate, and that rate. For each M in 1..k every adapter sequence
    drafts M (`lengths_for`); then, once a verify token's cost is known (two measured sizes, and a cycle bound by
    its device time: `verify_token_cost`), each keeps only the drafts that repay their verify tokens, and at least
    one: its j-th draft adds a^j expected tokens for one more verify token, worth it while a^j >= rate x seconds per
    verify token. A closed batch keeps its drafts (it waits for its slowest sequence). Nothing measured yet: M = 1,
    the cheapest cycle that measures both pass kinds."""
    best, best_rate = lengths_for(batch, 1, min_acceptance), None
    for passes in range(1, k + 1):
        cand = lengths_for(batch, passes, min_acceptance)
        rate = cycle_rate(costs, batch, cand)
        if rate is None:
            continue
        per_token = verify_token_cost(costs, batch, cand)
        if per_token > 0 and passes > 1 and not batch.closed:
            worth = rate * per_token
            pruned = [min(m, max(1, useful_drafts(a, worth))) if m > 1 else m for m, a in zip(cand, batch.accs)]
            if pruned != cand:
                cand, rate = pruned, cycle_rate(costs, batch, pruned, slowest=False)
        if best_rate is None or rate > best_rate:
            best, best_rate = cand, rate
    return best, best_rate


def plain_rate(batch: Batch, t_plain: float) -> float:
    """Tokens per second of plain steps: one per sequence a step (a closed batch priced by its slowest: its tokens
    over the steps its longest sequence takes)."""
    if batch.slowest:
        return sum(batch.slowest) / (max(batch.slowest) * t_plain)
    return (len(batch.accs) + batch.num_base) / t_plain
