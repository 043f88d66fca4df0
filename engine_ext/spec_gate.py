"""When drafting pays: a cost model fed by measured pass times and per-adapter acceptance rates.

A cycle that drafts m tokens for a sequence whose drafts are accepted with probability a yields
E(a, m) = (1 - a^(m+1)) / (1 - a) tokens (the accepted run plus the target's own token). It costs
`max m` base-only passes plus one adapter-on verify pass over sum(m + 1) tokens, against one
adapter-on pass per token for plain multi-LoRA decoding. Times are measured, per bucket of (tokens in
the pass, distinct adapters), as exponential moving averages. A greedy cycle queues all its passes
before its one host sync, so its passes are timed on the device (PassClock), and the rest of the
engine step's wall time (host work not hidden behind the device: scheduling, packing the first pass,
the sync, settling the tokens, the engine's output processing) is recorded once per cycle as its
"overhead", by batch size. A cycle is predicted at overhead + M drafting passes + the verify pass: the
overhead is paid once whatever M is, which is what makes longer cycles cheaper per token. (Spreading it
over the passes in proportion to their device time, as an earlier version did, charged it M times over
and made every M look alike.) Plain steps are timed by the wall clock of the whole engine step, their
scheduling and output processing included (paid per token, where a cycle pays them once: leaving them
out made plain look about 40% cheaper than it is at batch 32 on the H200). A sampled cycle syncs after
every pass, so its passes are timed by wall clock one by one, and the rest of its step is its overhead.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass

import torch

from .config import SpecConfig

logger = logging.getLogger(__name__)


def expected_tokens(acceptance: float, m: int) -> float:
    if acceptance >= 1.0:
        return m + 1.0
    return (1.0 - acceptance ** (m + 1)) / (1.0 - acceptance)


def _bucket(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass
class AdapterAcceptance:
    """Per-token acceptance a: the chance a draft is accepted given the drafts before it were.
    Drafts after the first rejection are never judged, so a = accepted / (accepted + rejections),
    not accepted / drafted (which would fall with the draft length for the same adapter)."""

    ema: float
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0
    verifies: int = 0
    samples: int = 0
    idle_steps: int = 0  # plain steps since it last drafted (for probing a gated-off adapter)

    def observe(self, drafted: int, accepted: int, weight: float) -> None:
        judged = accepted + (accepted < drafted)
        self.drafted += drafted
        self.accepted += accepted
        self.rejected += accepted < drafted
        self.verifies += 1
        self.idle_steps = 0
        if judged:
            # A running mean over the first samples (the prior counts as one), then an EMA: a new adapter's
            # acceptance is learned in a few cycles, and drift is still followed later.
            self.samples += 1
            w = max(weight, 1.0 / (self.samples + 1))
            self.ema = (1 - w) * self.ema + w * (accepted / judged)

    @property
    def rate(self) -> float | None:
        judged = self.accepted + self.rejected
        return self.accepted / judged if judged else None


class StepTimes:
    """EMA of measured wall time per pass kind and (token bucket, distinct-adapter bucket)."""

    def __init__(self, weight: float = 0.2):
        self.weight = weight
        self._t: dict[tuple[str, int, int], float] = {}
        self._n: Counter[tuple[str, int, int]] = Counter()

    def record(self, kind: str, tokens: int, adapters: int, seconds: float) -> None:
        key = (kind, _bucket(tokens), _bucket(adapters) if adapters else 0)
        self._n[key] += 1
        old = self._t.get(key)
        # The second sample at a shape replaces the first, which may carry one-off costs (kernel selection,
        # first-touch memory); later ones are averaged in. (A pass that captured CUDA graphs, seconds long,
        # is never recorded: see Speculator.)
        if old is None or self._n[key] == 2:
            self._t[key] = seconds
        else:
            self._t[key] = (1 - self.weight) * old + self.weight * seconds

    def get(self, kind: str, tokens: int, adapters: int, exact: bool = False) -> float | None:
        """The measured time at this bucket; else (unless `exact`) that of the nearest measured bucket of the
        same kind (token and adapter buckets compared on a log scale), unscaled. The fallback is meant to be
        optimistic for the pass it prices: a decision it drives runs that pass and so measures the missing
        bucket, while a pessimistic guess would keep the gate from ever trying it. None if never measured."""
        ab = _bucket(adapters) if adapters else 0
        tb = _bucket(tokens)
        measured = self._t.get((kind, tb, ab))
        if measured is not None or exact:
            return measured
        known = [(t, a, v) for (k, t, a), v in self._t.items() if k == kind]
        if not known:
            return None
        return min(known, key=lambda e: abs(e[0].bit_length() - tb.bit_length()) + abs(e[1].bit_length() - ab.bit_length()))[2]


class PassClock:
    """Durations of forwards queued without a host sync, read after the cycle's one sync: CUDA events on a
    GPU (each span is that pass's share of the device timeline); elsewhere every pass is synchronous and
    the host clock times it."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._events: list = []  # reused across cycles: read only after the sync that completes them
        self._marks: list = []

    def mark(self) -> None:
        """At the start of the first pass, then after each pass is queued."""
        if not self.cuda:
            self._marks.append(time.perf_counter())
            return
        if len(self._events) == len(self._marks):
            self._events.append(torch.cuda.Event(enable_timing=True))
        event = self._events[len(self._marks)]
        event.record()
        self._marks.append(event)

    def spans(self) -> list[float]:
        """Seconds between consecutive marks (call after a sync that covers every pass), and reset."""
        marks, self._marks = self._marks, []
        if self.cuda:
            return [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(marks)]
        return [b - a for a, b in itertools.pairwise(marks)]


class Gate:
    def __init__(self, cfg: SpecConfig, probe_interval: int = 64):
        self.cfg = cfg
        self.times = StepTimes()
        self.acceptance: dict[str, AdapterAcceptance] = {}
        self.decisions: Counter[str] = Counter()
        self.recent_plain_cost: deque[str] = deque(maxlen=8)  # why the latest cost-based plain decisions
        self.probe_interval = probe_interval
        self.plain_streak = 0  # consecutive plain decisions; a probe cycle refreshes stale measurements

    def adapter(self, name: str) -> AdapterAcceptance:
        if name not in self.acceptance:
            self.acceptance[name] = AdapterAcceptance(ema=self.cfg.initial_acceptance)
        return self.acceptance[name]

    def gated_off(self, adapters: list[str]) -> bool:
        """True when no adapter of the batch would draft, known without the cost model: the gate is on, every
        adapter's acceptance is below min_acceptance, none is due a re-measure and no probe cycle is due
        (draft_lengths would return all zeros and decide() count plain_low_acceptance)."""
        if not self.cfg.gate or not adapters or (self.probe_interval and self.plain_streak >= self.probe_interval):
            return False
        for name in set(adapters):
            a = self.adapter(name)
            if a.ema >= self.cfg.min_acceptance or (self.probe_interval and a.idle_steps >= self.probe_interval):
                return False
        return True

    def draft_lengths(self, adapters: list[str], caps: list[int], batch: int) -> list[int]:
        """Per adapter sequence, a draft length in 0..min(k, cap).

        A cycle costs max(lengths) base passes plus one verify pass, so every adapter worth drafting for
        drafts the same number of passes M (extra verify tokens are cheap beside the passes every adapter
        shares); M in 1..k maximises the cost model's predicted tokens per second (measured pass times,
        per-adapter acceptance). Adapters below `min_acceptance` draft nothing (one token when a long run
        of plain steps calls for a re-measure). With nothing measured yet, M = 1: the cheapest cycle
        that measures both pass kinds."""
        k = self.cfg.num_draft_tokens
        if not self.cfg.gate:
            return [min(k, c) for c in caps]
        low = [self.adapter(n).ema < self.cfg.min_acceptance for n in adapters]
        relearn = [bool(self.probe_interval) and self.adapter(n).idle_steps >= self.probe_interval for n in adapters]

        def lengths(passes: int) -> list[int]:
            return [min(1 if lo else passes, cap) if not lo or again else 0
                    for lo, again, cap in zip(low, relearn, caps)]

        if self.probe_interval and self.plain_streak >= self.probe_interval:
            return lengths(1)  # a long run of plain steps re-measures drafting with the cheapest cycle
        num_base = batch - len(adapters)
        best, best_rate = 1, None
        for passes in range(1, k + 1):
            rate = self.predicted_rate(adapters, lengths(passes), num_base)
            if rate is not None and (best_rate is None or rate > best_rate):
                best, best_rate = passes, rate
        return lengths(best)

    def adapter_on_time(self, tokens: int, distinct: int) -> float | None:
        """An adapter-on pass of `tokens` tokens: a verify pass or a plain step measured at that size, else the
        nearest verify pass, else the nearest plain step (both optimistic for larger passes: a decision they
        drive measures the size)."""
        for kind, exact in (("lora", True), ("plain", True), ("lora", False), ("plain", False)):
            t = self.times.get(kind, tokens, distinct, exact=exact)
            if t is not None:
                return t
        return None

    def predicted_rate(self, adapters: list[str], lengths: list[int], num_base: int) -> float | None:
        """Tokens per second of a cycle with these draft lengths (None: a pass kind never measured)."""
        passes = max(lengths, default=0)
        if not passes:
            return None
        batch, distinct = len(adapters) + num_base, len(set(adapters))
        t_base = self.times.get("base", batch, 0)
        t_verify = self.adapter_on_time(sum(m + 1 for m in lengths) + num_base, distinct)
        if t_base is None or t_verify is None:
            return None
        t_over = self.times.get("overhead", batch, 0) or 0.0  # once per cycle (greedy cycles; see above)
        gained = sum(expected_tokens(self.adapter(a).ema, m) for a, m in zip(adapters, lengths))
        return (gained + num_base * (passes + 1)) / (t_over + passes * t_base + t_verify)

    def decide(self, adapters: list[str], lengths: list[int], num_base: int, caps: list[int] | None = None) -> bool:
        """True: run a speculative cycle with these draft lengths (one per adapter sequence);
        False: a plain multi-LoRA step. `num_base`: base-only sequences decoding beside them."""
        batch, distinct = len(adapters) + num_base, len(set(adapters))
        if not self.cfg.gate:
            self.count("speculate_forced" if any(lengths) else "plain_nothing_to_draft", "gate disabled")
            return any(lengths)
        if not any(lengths):
            if caps is not None and not any(caps):
                self.count("plain_nothing_to_draft", "every sequence is one token from its end")
            elif all(self.adapter(a).ema < self.cfg.min_acceptance for a in adapters):
                self.count("plain_low_acceptance", "every adapter's acceptance is below the drafting threshold")
            else:
                self.count("plain_cost", "no draft length repays its base passes at the measured costs")
            return False
        if self.probe_interval and self.plain_streak >= self.probe_interval:
            self.count("speculate_probe", f"{self.plain_streak} plain steps in a row: re-measure drafting")
            return True
        # Plain steps are their own kind: pricing plain at the nearest adapter-on pass (usually a larger verify
        # pass) would make it look slower than it is, and speculation would then never measure plain. The
        # nearest plain step serves a batch size not measured yet (as sequences finish, the batch shrinks).
        t_plain = self.times.get("plain", batch, distinct)
        spec_rate = self.predicted_rate(adapters, lengths, num_base)
        if spec_rate is None:
            self.count("speculate_explore", "no base-only or adapter-on pass measured yet")
            return True
        if t_plain is None:
            self.count("plain_explore", "plain step time at this batch not measured yet")
            return False
        plain_rate = (len(lengths) + num_base) / t_plain
        if spec_rate > plain_rate:
            self.count("speculate", f"{spec_rate:.1f} tok/s speculative > {plain_rate:.1f} tok/s plain")
            return True
        self.count("plain_cost", f"{spec_rate:.1f} tok/s speculative <= {plain_rate:.1f} tok/s plain")
        return False

    def count(self, decision: str, why: str) -> None:
        """Record a decision (decide()'s own, and the speculator's gated-off fast path's)."""
        self.decisions[decision] += 1
        if decision == "plain_cost":
            self.recent_plain_cost.append(why)
        self.plain_streak = self.plain_streak + 1 if decision.startswith("plain") else 0
        logger.debug("gate: %s (%s)", decision, why)
