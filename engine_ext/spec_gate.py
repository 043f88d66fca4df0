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
import math
import time
from collections import Counter, deque

import torch

from .config import SpecConfig

logger = logging.getLogger(__name__)


def expected_tokens(acceptance: float, m: int) -> float:
    if acceptance >= 1.0:
        return m + 1.0
    return (1.0 - acceptance ** (m + 1)) / (1.0 - acceptance)


def _useful_drafts(acceptance: float, worth: float) -> int:
    """The most drafts j with acceptance^j >= worth: the j-th draft's expected tokens against its cost."""
    if worth <= 0.0 or acceptance >= 1.0:
        return 1 << 30
    if acceptance <= 0.0 or worth >= 1.0:
        return 0
    return int(math.log(worth) / math.log(acceptance) + 1e-9)


def _bucket(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class AdapterAcceptance:
    """Per-token acceptance a: the chance a draft is accepted given the drafts before it were.
    Drafts after the first rejection are never judged, so a = accepted / (accepted + rejections),
    not accepted / drafted (which would fall with the draft length for the same adapter).

    The running estimate (`ema`) is a ratio of exponentially decayed counts, accepted over judged drafts, each
    decayed by `weight` per verify: every judged draft counts alike, which is the estimate of a for drafts
    that stop at the first rejection. (An average of per-verify ratios, as an earlier version kept, let one
    early rejection, a ratio of 0 from one judged draft, weigh as much as a fully accepted cycle of four:
    at a = 0.985 an adapter's estimate dropped by up to 10 points after each rare rejection.) The prior
    counts as one judged draft, so a new adapter's estimate is its own within a few verifies. (Weighed as
    two, a perfect rank-16 adapter's first verify left it at 0.87, where plain looked faster, and plain
    steps learn nothing until a probe: see tests/engine_ext/test_gate_simulated.py.)"""

    PRIOR_DRAFTS = 1.0  # the judged drafts the prior (or a value set on `ema`) counts as

    def __init__(self, ema: float):
        self.ema = ema
        self.drafted = self.accepted = self.rejected = self.verifies = 0
        self.idle_steps = 0  # plain steps since it last drafted (for probing a gated-off adapter)

    @property
    def ema(self) -> float:
        return self._accepted_w / self._judged_w

    @ema.setter
    def ema(self, value: float) -> None:  # a prior (or a test's state): PRIOR_DRAFTS judged drafts at this rate
        self._accepted_w, self._judged_w = value * self.PRIOR_DRAFTS, self.PRIOR_DRAFTS

    def observe(self, drafted: int, accepted: int, weight: float) -> None:
        judged = accepted + (accepted < drafted)
        self.drafted += drafted
        self.accepted += accepted
        self.rejected += accepted < drafted
        self.verifies += 1
        self.idle_steps = 0
        if judged:
            keep = 1.0 - weight
            self._accepted_w = keep * self._accepted_w + accepted
            self._judged_w = keep * self._judged_w + judged

    @property
    def rate(self) -> float | None:
        judged = self.accepted + self.rejected
        return self.accepted / judged if judged else None


class StepTimes:
    """EMA of measured wall time per pass kind and (token bucket, distinct-adapter bucket), with the mean token
    count of the passes each bucket measured (to interpolate between buckets)."""

    def __init__(self, weight: float = 0.2):
        self.weight = weight
        self._t: dict[tuple[str, int, int], float] = {}
        self._tokens: dict[tuple[str, int, int], float] = {}
        self._n: Counter[tuple[str, int, int]] = Counter()
        self._lines: dict[str, dict[int, list[tuple[float, float]]]] = {}  # slope's points, until the next record
        self.version = 0  # bumped when a record changes what a cycle is priced at (plain steps do not, once a
        self._has_lora = False  # verify pass is measured): draft_lengths' cache key

    def record(self, kind: str, tokens: int, adapters: int, seconds: float) -> None:
        key = (kind, _bucket(tokens), _bucket(adapters) if adapters else 0)
        self._n[key] += 1
        self._lines.pop(kind, None)
        if kind != "plain" or not self._has_lora:  # what a cycle's price reads (Gate.adapter_on_time) has changed
            self.version += 1
        self._has_lora = self._has_lora or kind == "lora"
        old = self._t.get(key)
        # The second sample at a shape replaces the first, which may carry one-off costs (kernel selection,
        # first-touch memory); later ones are averaged in. (A pass that captured CUDA graphs, seconds long,
        # is never recorded: see Speculator.)
        if old is None or self._n[key] == 2:
            self._t[key], self._tokens[key] = seconds, float(tokens)
        else:
            self._t[key] = (1 - self.weight) * old + self.weight * seconds
            self._tokens[key] = (1 - self.weight) * self._tokens[key] + self.weight * tokens

    def get(self, kind: str, tokens: int, adapters: int, exact: bool = False) -> float | None:
        """Seconds for a pass of this kind, tokens and adapters, priced from the measurements:
        - its bucket measured: that time, moved along the measured cost per token (`slope`) to this pass's size
          (a bucket holds passes of up to twice the tokens: the verify passes of two and of three drafting
          passes share the 128-token bucket at batch 32, and were priced alike, so the longer cycle always
          looked better);
        - else (unless `exact`, which returns None) between two measured buckets of the same kind and adapter
          bucket: the straight line through them in token count (pass time is close to affine in tokens at
          these sizes). The nearest of two equally near buckets, the guess before, priced a 128-token verify
          pass at a 64-token one's time rather than between it and a 160-token one, and the gate ran the
          shorter cycle once more per window;
        - else the nearest measured bucket of the same kind (token and adapter buckets compared on a log
          scale), unscaled. That is meant to be optimistic for the larger pass it usually prices: a decision it
          drives runs that pass and so measures the missing bucket, while a pessimistic guess would keep the
          gate from ever trying it.
        None if this kind was never measured."""
        ab = _bucket(adapters) if adapters else 0
        tb = _bucket(tokens)
        measured = self._t.get((kind, tb, ab))
        if measured is not None:  # moved along the measured cost per token to this pass's own size in the bucket
            off = tokens - self._tokens[(kind, tb, ab)]
            return max(0.5 * measured, measured + self.slope(kind, tokens, adapters) * off) if off else measured
        if exact:
            return None
        known = [(t, a, v) for (k, t, a), v in self._t.items() if k == kind]
        if not known:
            return None
        below = max((t for t, a, _ in known if a == ab and t < tb), default=None)
        above = min((t for t, a, _ in known if a == ab and t > tb), default=None)
        if below is not None and above is not None:
            lo, hi = (kind, below, ab), (kind, above, ab)
            n_lo, n_hi = self._tokens[lo], self._tokens[hi]
            if n_hi > n_lo:
                f = min(1.0, max(0.0, (tokens - n_lo) / (n_hi - n_lo)))
                return self._t[lo] + f * (self._t[hi] - self._t[lo])
        return min(known, key=lambda e: abs(e[0].bit_length() - tb.bit_length())
                   + abs(e[1].bit_length() - ab.bit_length()))[2]

    def slope(self, kind: str, tokens: int, adapters: int) -> float:
        """Seconds per token of this kind's passes near `tokens`: the line through the two measured buckets around
        it, else through the two nearest, in this adapter bucket or else the nearest one with two sizes measured
        (the per-token work does not depend on how many adapters the pass reads). 0.0 until two sizes are."""
        ab = _bucket(adapters) if adapters else 0
        lines = self._lines.get(kind)
        if lines is None:  # (token count, seconds) by adapter bucket, where two sizes or more are measured
            points: dict[int, list[tuple[float, float]]] = {}
            for key, v in self._t.items():
                if key[0] == kind:
                    points.setdefault(key[2], []).append((self._tokens[key], v))
            lines = self._lines[kind] = {a: sorted(p) for a, p in points.items() if len(p) >= 2}
        if not lines:
            return 0.0
        pts = lines[min(lines, key=lambda a: abs(a.bit_length() - ab.bit_length()))]
        i = min(max(1, sum(n < tokens for n, _ in pts)), len(pts) - 1)
        (n0, t0), (n1, t1) = pts[i - 1], pts[i]
        return max(0.0, (t1 - t0) / (n1 - n0)) if n1 > n0 else 0.0


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
        self.base_probe_interval = probe_interval
        self.probe_backoff = 1  # doubles after each probe that ends in plain again, up to MAX_PROBE_BACKOFF
        self._probed = False  # the last cycle was a probe, and no decision since has judged it
        # draft_lengths' last pick, its rate, and the closed batch's tokens to go when its slowest prices it
        self._chosen: tuple[list[int] | None, float | None, list[int] | None] = (None, None, None)
        self._lengths_key: tuple | None = None
        self.last_margin: float | None = None
        self._lengths_value: tuple[list[int] | None, float | None, list[int] | None] = (None, None, None)
        self.plain_streak = 0  # consecutive plain decisions; a probe cycle refreshes stale measurements

    MAX_PROBE_BACKOFF = 8

    @property
    def probe_interval(self) -> int:
        """Plain steps between probe cycles (0: never): 64, doubling after every probe the gate answers with plain
        again, up to 8x, back to 64 once it speculates. A probe costs about a cycle's extra time over a plain
        step (2 ms at batch 32 on the H200); at a fixed 64 steps far adapters' batches paid about 1% for them."""
        return self.base_probe_interval * self.probe_backoff

    def adapter(self, name: str) -> AdapterAcceptance:
        if name not in self.acceptance:
            self.acceptance[name] = AdapterAcceptance(ema=self.cfg.initial_acceptance)
        return self.acceptance[name]

    def gated_off(self, adapters: list[str]) -> bool:
        """True when no adapter of the batch would draft, known without the cost model: the gate is on, every
        adapter's acceptance is below min_acceptance, none is due a re-measure and no probe cycle is due
        (draft_lengths would return all zeros and decide() count plain_low_acceptance)."""
        if not self.cfg.gate or not adapters or self.probe_due():
            return False
        for name in set(adapters):
            a = self.adapter(name)
            if a.ema >= self.cfg.min_acceptance or (self.probe_interval and a.idle_steps >= self.probe_interval):
                return False
        return True

    def probe_due(self) -> bool:
        return bool(self.probe_interval) and self.plain_streak >= self.probe_interval

    def hold_steps(self) -> int:
        """After decide(): how many plain steps of the same batch may follow without re-pricing. None unless the
        last decision was plain on cost, then one per 2% by which plain beat the best cycle, at most 16."""
        if self.last_margin is None:
            return 0
        return min(16, int(self.last_margin / 0.02))

    def draft_lengths(self, adapters: list[str], caps: list[int], batch: int,
                      left: list[int] | None = None) -> list[int]:
        """Per adapter sequence, a draft length in 0..min(k, cap).

        A cycle costs M = max(lengths) base passes plus one verify pass over sum(m + 1) tokens. For each M in
        1..k every adapter first drafts M, or one token if its acceptance is below `min_acceptance`; then, once
        the verify pass's cost per token is known (two measured sizes), each keeps only the drafts that repay
        their verify tokens, and at least one: its j-th draft adds a^j expected tokens for one more verify
        token, worth it while a^j >= rate x seconds per verify token (rate: the cycle's predicted tokens per
        second). M maximises the predicted rate. With nothing measured yet, M = 1: the cheapest cycle that
        measures both pass kinds.

        `left` (each sequence's tokens to go) marks a closed batch: nothing waits to join it, so it is done
        when its slowest sequence is. With a laggard among them (`_estimates`), the rate is the batch's tokens
        over the time its slowest sequence takes, at this cycle or at plain steps (decide), and no draft is
        pruned. Priced by tokens per second alone, a batch of mixed adapters kept cycling for its fast ones
        while its slow ones fell behind, and then finished alone at a few tokens per cycle, 14-16% slower
        over the batch than plain steps (the simulated test's mixed batches).

        Every adapter drafts in a cycle the others run: its first draft costs one verify token, next to
        nothing, and keeps its estimate current. Left out below `min_acceptance`, as an earlier version did,
        an unlucky adapter's sequences took one token per cycle (a third of plain decoding's rate, on a cycle
        of four passes) until a re-measure 64 steps later, and a batch whose window ended with them ran at
        that rate (tests/engine_ext/test_gate_simulated.py)."""
        k = self.cfg.num_draft_tokens
        if not self.cfg.gate:
            return [min(k, c) for c in caps]
        accs, slowest = self._estimates(adapters, left)
        low = [a < self.cfg.min_acceptance for a in accs]

        def lengths(passes: int) -> list[int]:
            return [min(1 if lo else passes, cap) for lo, cap in zip(low, caps)]

        if self.probe_due():
            return lengths(1)  # a long run of plain steps re-measures drafting with the cheapest cycle
        num_base = batch - len(adapters)
        distinct = len(set(adapters))
        # The same inputs give the same lengths: in a run of plain steps (where only plain's price moves) the search
        # below, ~0.1 ms of host time at batch 32, would otherwise be paid again every step.
        key = (tuple(accs), tuple(caps), batch, distinct, self.times.version, slowest and tuple(slowest))
        if key == self._lengths_key:
            self._chosen = self._lengths_value
            return self._lengths_value[0]
        best, best_rate = lengths(1), None
        for passes in range(1, k + 1):
            cand = lengths(passes)
            rate = self._rate(accs, cand, num_base, distinct, slowest)
            if rate is None:
                continue
            per_token = self.times.slope("lora", sum(cand) + len(cand) + num_base, distinct)
            if per_token > 0 and passes > 1 and left is None:  # (a closed batch waits for its slowest: keep drafts)
                worth = rate * per_token
                pruned = [min(m, max(1, _useful_drafts(a, worth))) if m > 1 else m for m, a in zip(cand, accs)]
                if pruned != cand:
                    cand, rate = pruned, self._rate(accs, pruned, num_base, distinct)
            if best_rate is None or rate > best_rate:
                best, best_rate = cand, rate
        self._chosen = self._lengths_value = (best, best_rate, slowest)  # decide() on these lengths reuses them
        self._lengths_key = key
        return best

    SHRINK_DRAFTS = 16.0  # judged drafts of the batch's pooled acceptance added to each estimate (closed batches)
    EVIDENCE = 8.0  # judged drafts every adapter of a closed batch needs before its slowest sequence prices it
    LAGGARD = 0.1  # how far below the pooled acceptance an estimate must be for its sequence to price the batch

    def _estimates(self, adapters: list[str], left: list[int] | None) -> tuple[list[float], list[int] | None]:
        """Each sequence's acceptance (its adapter's estimate), and `left` again if the closed batch is priced by
        its slowest sequence (`_rate`), else None. That takes a laggard: an estimate, pulled towards the batch's pooled
        one by SHRINK_DRAFTS judged drafts, still LAGGARD below it, once every adapter has EVIDENCE judged
        drafts. Otherwise the batch is priced by its tokens per second, as an open one:
        - the slowest of 32 estimates of the same acceptance is low by chance, and priced by it, a batch of
          equally good adapters went plain on a close call it should have drafted;
        - on a first draft or two, one unlucky draft did the same, and plain steps learn nothing until a
          probe (tests/engine_ext/test_gate_simulated.py)."""
        accs = [self.adapter(n) for n in adapters]
        if not left or min(a._judged_w for a in accs) < self.EVIDENCE:
            return [a.ema for a in accs], None
        pooled = sum(a._accepted_w for a in accs) / sum(a._judged_w for a in accs)
        k = self.SHRINK_DRAFTS
        shrunk = [(a._accepted_w + k * pooled) / (a._judged_w + k) for a in accs]
        if min(shrunk) > pooled - self.LAGGARD:
            return [a.ema for a in accs], None
        return shrunk, left

    def note_step(self, adapters: list[str], lengths: list[int] | None) -> None:
        """After a step: the adapters that drafted nothing in it (every one, in a plain step; in a cycle, one whose
        sequences were a token from their end) count it towards their re-measure (`idle_steps`)."""
        drafting = set() if lengths is None else {n for n, m in zip(adapters, lengths) if m}
        for name in set(adapters) - drafting:
            self.adapter(name).idle_steps += 1

    def adapter_on_time(self, tokens: int, distinct: int) -> float | None:
        """An adapter-on pass of `tokens` tokens: from the verify passes measured (`StepTimes.get`), else, before
        any cycle, the nearest plain step (optimistic for a larger pass: a decision it drives measures the
        size). A plain step is not used once verify passes are measured: it is timed by the whole engine step,
        host work included, which the cycle's overhead already counts."""
        t = self.times.get("lora", tokens, distinct)
        return t if t is not None else self.times.get("plain", tokens, distinct)

    def predicted_rate(self, adapters: list[str], lengths: list[int], num_base: int) -> float | None:
        """Tokens per second of a cycle with these draft lengths (None: a pass kind never measured)."""
        return self._rate([self.adapter(a).ema for a in adapters], lengths, num_base, len(set(adapters)))

    def _rate(self, accs: list[float], lengths: list[int], num_base: int, distinct: int,
              slowest: list[int] | None = None) -> float | None:
        """predicted_rate's arithmetic. `slowest`: a closed batch's tokens to go, when its slowest sequence prices
        it (`_estimates`): the batch's tokens over the time that sequence takes at this cycle."""
        passes = max(lengths, default=0)
        if not passes:
            return None
        batch = len(accs) + num_base
        t_base = self.times.get("base", batch, 0)
        t_verify = self.adapter_on_time(sum(lengths) + len(lengths) + num_base, distinct)
        if t_base is None or t_verify is None:
            return None
        t_over = self.times.get("overhead", batch, 0) or 0.0  # once per cycle (greedy cycles; see above)
        t_cycle = t_over + passes * t_base + t_verify
        gains = [expected_tokens(a, m) for a, m in zip(accs, lengths)]
        if slowest:
            return sum(slowest) / (max(n / g for n, g in zip(slowest, gains)) * t_cycle)
        return (sum(gains) + num_base * (passes + 1)) / t_cycle

    def decide(self, adapters: list[str], lengths: list[int], num_base: int, caps: list[int] | None = None,
               left: list[int] | None = None) -> bool:
        """True: run a speculative cycle with these draft lengths (one per adapter sequence);
        False: a plain multi-LoRA step. `num_base`: base-only sequences decoding beside them."""
        batch, distinct = len(adapters) + num_base, len(set(adapters))
        self.last_margin = None  # how much faster plain was priced, when this decides plain on cost
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
        if self.probe_due():
            self.count("speculate_probe", f"{self.plain_streak} plain steps in a row: re-measure drafting")
            return True
        # Plain steps are their own kind: pricing plain at the nearest adapter-on pass (usually a larger verify
        # pass) would make it look slower than it is, and speculation would then never measure plain. A batch
        # size (bucket) not measured yet is measured by one plain step: priced from a larger batch's step, as
        # an earlier version did, plain looked dearer than it is as sequences finished, and a batch left with
        # its slow-drafting sequences kept cycling where plain steps would have finished it sooner.
        t_plain = self.times.get("plain", batch, distinct, exact=True)
        chosen, spec_rate, slowest = self._chosen
        if lengths is not chosen or spec_rate is None:
            accs, slowest = self._estimates(adapters, left)
            spec_rate = self._rate(accs, lengths, num_base, distinct, slowest)
        if spec_rate is None:
            self.count("speculate_explore", "no base-only or adapter-on pass measured yet")
            return True
        if t_plain is None:
            self.count("plain_explore", "plain step time at this batch not measured yet")
            return False
        plain_rate = sum(slowest) / (max(slowest) * t_plain) if slowest else (len(lengths) + num_base) / t_plain
        if spec_rate > plain_rate:
            self.count("speculate", f"{spec_rate:.1f} tok/s speculative > {plain_rate:.1f} tok/s plain")
            return True
        self.count("plain_cost", f"{spec_rate:.1f} tok/s speculative <= {plain_rate:.1f} tok/s plain")
        self.last_margin = plain_rate / spec_rate - 1.0
        return False

    def count(self, decision: str, why: str) -> None:
        """Record a decision (decide()'s own, and the speculator's gated-off fast path's)."""
        self.decisions[decision] += 1
        if decision == "speculate_probe":
            self._probed = True
        elif decision.startswith("speculate"):
            self._probed, self.probe_backoff = False, 1
        elif self._probed and decision in ("plain_low_acceptance", "plain_cost"):  # the probe did not pay
            self._probed, self.probe_backoff = False, min(self.MAX_PROBE_BACKOFF, 2 * self.probe_backoff)
        if decision == "plain_cost":
            self.recent_plain_cost.append(why)
        self.plain_streak = self.plain_streak + 1 if decision.startswith("plain") else 0
        logger.debug("gate: %s (%s)", decision, why)
