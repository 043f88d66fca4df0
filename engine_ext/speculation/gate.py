"""When drafting pays: per step, a plan (plain step or speculative cycle, and each sequence's draft length)
from a cost model fed by measured pass times and per-adapter acceptance.

A cycle that drafts m tokens for a sequence whose drafts are accepted with probability a yields
E(a, m) = (1 - a^(m+1)) / (1 - a) tokens. It costs its overhead (host work paid once per cycle) plus
M = max m base-only passes plus one adapter-on verify pass over sum(m + 1) tokens, against one plain
adapter-on step per token. The overhead being paid once whatever M is makes longer cycles cheaper per
token. Plain steps are priced by the wall time of the whole engine step (scheduling and output processing
included, which a plain step pays per token and a cycle once)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from ..config import SpecConfig
from ..scheduler import ScheduledBatch
from ..sequence import Sequence
from ..stats import EngineStats, SpecStats
from .acceptance import AdapterAcceptance, expected_tokens, useful_drafts
from .cost import StepTimes

logger = logging.getLogger(__name__)


class Decision(str, Enum):
    SPECULATE = "speculate"  # the cost model priced the cycle faster
    SPECULATE_FORCED = "speculate_forced"  # gate off: every step drafts
    SPECULATE_PROBE = "speculate_probe"  # a long run of plain steps: re-measure drafting
    SPECULATE_EXPLORE = "speculate_explore"  # a pass kind never measured: measure it
    PLAIN_COST = "plain_cost"  # the cost model priced plain faster
    PLAIN_HOLD = "plain_hold"  # plain again for the same batch after a wide-margin plain decision
    PLAIN_LOW_ACCEPTANCE = "plain_low_acceptance"  # every adapter's acceptance is below min_acceptance
    PLAIN_UNRESERVED = "plain_unreserved"  # no drafting room was reserved this step
    PLAIN_NOTHING_TO_DRAFT = "plain_nothing_to_draft"  # every sequence is a token from its end
    PLAIN_EXPLORE = "plain_explore"  # plain at this batch size never measured: measure it

    @property
    def speculates(self) -> bool:
        return self in _SPECULATE


_SPECULATE = {Decision.SPECULATE, Decision.SPECULATE_FORCED, Decision.SPECULATE_PROBE, Decision.SPECULATE_EXPLORE}


@dataclass
class Plan:
    """What one engine step runs."""

    seqs: list[Sequence] = field(default_factory=list)  # the scheduled batch
    speculate: bool = False
    lengths: dict[int, int] = field(default_factory=dict)  # id(seq) -> draft length, adapter sequences decoding
    # Sequences decoding in every drafting pass, each pass a plain step for them: base-only ones, and adapter ones
    # that ride (Gate.rides) with their adapter on in those passes instead of drafting
    riders: list[Sequence] = field(default_factory=list)
    decoding: int = 0  # sequences decoding (the rest are prefills)
    distinct: int = 0  # distinct adapters among the decoding sequences
    timed: bool = True  # False while the step may capture CUDA graphs: its times are no pass's
    # How many tokens a prompt computed in one of the cycle's drafting passes may draft in the passes after it
    # (Gate.prompt_drafts; the cycle caps it by the passes left and the tokens it may still generate)
    prompt_drafts: Callable[[Sequence], int] = field(default=lambda s: 0, repr=False)


@dataclass
class StepResult:
    """What a step measured and verified, for the gate (`Gate.observe`)."""

    passes: list[tuple[str, int, int, float]] = field(default_factory=list)  # (kind, tokens, adapters, seconds)
    verifies: list[tuple[str, int, int]] = field(default_factory=list)  # (adapter, drafted, accepted)


class NoSpeculation:
    """The plan source when speculation is off: every step is plain, with no drafting room."""

    lookahead = 0

    def plan(self, batch: ScheduledBatch) -> Plan:
        return Plan(seqs=batch.seqs)

    def observe(self, plan: Plan, result: StepResult, seconds: float) -> None:
        pass

    def estimates(self) -> dict[str, float]:
        return {}


class Gate:
    """Plans each step (`plan`) and learns from it (`observe`). `max_model_len` bounds draft lengths; `capturing`
    says whether the next forward may still capture CUDA graphs (a step that does is not timed)."""

    MAX_PROBE_BACKOFF = 8
    SHRINK_DRAFTS = 16.0  # judged drafts of the batch's pooled acceptance added to each estimate (closed batches)
    EVIDENCE = 8.0  # judged drafts every adapter of a closed batch needs before its slowest sequence prices it
    LAGGARD = 0.1  # how far below the pooled acceptance an estimate must be for its sequence to price the batch
    MAX_HOLD = 16  # plain steps of one batch without re-pricing, after a wide-margin plain decision

    def __init__(self, cfg: SpecConfig, probe_interval: int = 64, max_model_len: int = 1 << 30,
                 capturing: Callable[[], bool] = lambda: False, stats: EngineStats | None = None):
        self.cfg = cfg
        self.max_model_len = max_model_len
        self.capturing = capturing
        self.stats = stats or EngineStats()
        if self.stats.spec is None:
            self.stats.spec = SpecStats(cfg.num_draft_tokens)
        self.counters: SpecStats = self.stats.spec
        self.times = StepTimes()
        self.acceptance: dict[str, AdapterAcceptance] = {}
        self.base_probe_interval = probe_interval
        self.probe_backoff = 1  # doubles after each probe that ends in plain again, up to MAX_PROBE_BACKOFF
        self.plain_streak = 0  # consecutive plain decisions; a probe cycle refreshes stale measurements
        self.last_margin: float | None = None  # how much faster plain was priced, when decide chose plain on cost
        self._probed = False  # the last cycle was a probe, and no decision since has judged it
        self._reserve = True  # reserve drafting room at the next schedule
        self._hold, self._hold_names = 0, []  # plain steps left without re-pricing, and for which batch
        # draft_lengths' pick for the current batch (adapters, lengths, rate, slowest), which decide() reuses,
        # and its last search (inputs, (lengths, rate, slowest)), which the next call with equal inputs reuses
        self._choice: tuple[list[str], list[int], float | None, list[int] | None] | None = None
        self._search: tuple[tuple, tuple[list[int], float | None, list[int] | None]] | None = None

    # ------------------------------------------------------------ the step
    @property
    def lookahead(self) -> int:
        """Drafting room to reserve at this step's scheduling: none after a step found every adapter gated off
        or chose plain by a wide margin, until a step could draft again."""
        return self.cfg.num_draft_tokens if self._reserve else 0

    def plan(self, batch: ScheduledBatch) -> Plan:
        decoding = [s for s in batch.seqs if not s.is_prefill]
        lora = [s for s in decoding if s.adapter is not None]
        names = [s.adapter for s in lora]
        plan = Plan(seqs=batch.seqs, riders=[s for s in decoding if s.adapter is None], decoding=len(decoding),
                    distinct=len(set(names)), timed=not self.capturing())
        if batch.empty:
            return plan
        ride = [self.rides(s) for s in lora]
        lengths = self._choose(lora, names, len(decoding), len(plan.riders), batch, ride)
        self.note_step(names, lengths)
        if lengths is None:
            self.counters.plain_steps += 1
        else:
            self.counters.cycles += 1
            plan.speculate, plan.lengths = True, dict(zip(map(id, lora), lengths))
            chosen: dict[str, int] = {}
            for name, m in zip(names, lengths):
                chosen[name] = max(m, chosen.get(name, 0))
            plan.prompt_drafts = lambda s: self.prompt_drafts(s, chosen)
            plan.riders += [s for s, r in zip(lora, ride) if r]
        return plan

    def prompt_drafts(self, s: Sequence, chosen: dict[str, int]) -> int:
        """Drafts for a prompt computed in a drafting pass, in the passes after it: none when it is base-only (it
        rides: the drafting passes are its own model), its params rule drafting out or its adapter rides; else the
        longest draft `chosen` for its adapter's sequences in this plan, or, for an adapter the plan has none of,
        one token below min_acceptance (as draft_lengths gives it) and no limit otherwise."""
        if s.adapter is None or not s.params.can_draft or self.rides(s):
            return 0
        if s.adapter in chosen:
            return chosen[s.adapter]
        return 1 if self.cfg.gate and self.adapter(s.adapter).ema < self.cfg.min_acceptance else 1 << 30

    def rides(self, s: Sequence) -> bool:
        """An adapter sequence decodes in the drafting passes with its adapter on (a token per pass, as a base-only
        sequence does) instead of drafting, when its adapter's acceptance is below min_acceptance: drafting would
        give it about one token per cycle, as slow as the cycle is long, where riding gives one per pass. Its
        adapter is re-measured (one draft) once it has ridden `probe_interval` steps. Not with the gate off."""
        if not self.cfg.gate or not s.params.can_draft:
            return False
        a = self.adapter(s.adapter)
        return a.ema < self.cfg.min_acceptance and not (self.probe_interval and a.idle_steps >= self.probe_interval)

    def _choose(self, lora: list[Sequence], names: list[str], decoding: int, num_base: int,
                batch: ScheduledBatch, ride: list[bool]) -> list[int] | None:
        """Draft lengths for the adapter sequences, or None for a plain step."""
        if not lora:
            return None
        if self.gated_off(names):  # known without the cost model: every adapter drafts nothing
            self.count(Decision.PLAIN_LOW_ACCEPTANCE, "every adapter's acceptance is below the drafting threshold")
            self._reserve = False
            return None
        if self._hold and names == self._hold_names and not self.probe_due():
            self._hold -= 1
            self.count(Decision.PLAIN_HOLD, "a recent cost decision chose plain for this batch by a wide margin")
            self._reserve = not self._hold
            return None
        if not batch.lookahead:
            self.count(Decision.PLAIN_UNRESERVED, "no drafting room reserved this step")
            self._reserve = True
            return None
        caps = [self._cap(s) for s in lora]
        left = [s.tokens_left(self.max_model_len) for s in lora] if batch.closed else None
        lengths = self.draft_lengths(names, caps, decoding, left, ride)
        speculate = self.decide(names, lengths, num_base, caps, left, ride, prompts=len(batch.seqs) - decoding)
        self._hold, self._hold_names = (0 if speculate else self.hold_steps()), names
        self._reserve = not self._hold
        return lengths if speculate else None

    def observe(self, plan: Plan, result: StepResult, seconds: float) -> None:
        """After the step (`seconds`: its whole wall time): per-adapter acceptance from the verify pass, and pass
        times: each measured pass, then the rest of a cycle's step as its overhead, or a decode-only plain step
        at its whole time (a step with prompts in it prices no plain decoding)."""
        for name, drafted, accepted in result.verifies:
            self.adapter(name).observe(drafted, accepted, self.cfg.acceptance_ema)
            self.stats.adapter(name).observe_verify(drafted, accepted)
        if not plan.timed and not self.capturing():
            return  # this step captured the CUDA graphs: seconds of it are no pass's
        for pass_time in result.passes:
            if pass_time[0] != "prompted":  # prompts ran in it: what it took prices no draft length
                self.times.record(*pass_time)
        if plan.speculate:
            spent = sum(p[3] for p in result.passes)
            self.times.record("overhead", len(plan.seqs), 0, max(0.0, seconds - spent))
        elif plan.decoding and plan.decoding == len(plan.seqs):
            self.times.record("plain", plan.decoding, plan.distinct, seconds)

    def estimates(self) -> dict[str, float]:
        return {name: a.ema for name, a in self.acceptance.items()}

    def _cap(self, s: Sequence) -> int:
        """Longest useful draft: every accepted token plus the target's own must fit the sequence's end. A request
        whose params rule drafting out (SamplingParams.can_draft) drafts nothing: the verify pass is its plain step."""
        if not s.params.can_draft:
            return 0
        return max(0, min(self.cfg.num_draft_tokens, s.tokens_left(self.max_model_len) - 1))

    # ------------------------------------------------------------ acceptance and probes
    @property
    def probe_interval(self) -> int:
        """Plain steps between probe cycles (0: never): the base interval, doubling after every probe the gate
        answers with plain again, up to MAX_PROBE_BACKOFF times, back to the base once it speculates."""
        return self.base_probe_interval * self.probe_backoff

    def adapter(self, name: str) -> AdapterAcceptance:
        if name not in self.acceptance:
            self.acceptance[name] = AdapterAcceptance(ema=self.cfg.initial_acceptance)
        return self.acceptance[name]

    def gated_off(self, adapters: list[str]) -> bool:
        """True when no adapter of the batch would draft, known without the cost model: the gate is on, every
        adapter's acceptance is below min_acceptance, none is due a re-measure and no probe cycle is due."""
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
        last decision was plain on cost, then one per 2% by which plain beat the best cycle, at most MAX_HOLD."""
        if self.last_margin is None:
            return 0
        return min(self.MAX_HOLD, int(self.last_margin / 0.02))

    def note_step(self, adapters: list[str], lengths: list[int] | None) -> None:
        """After a step: the adapters that drafted nothing in it (every one, in a plain step; in a cycle, one whose
        sequences were a token from their end) count it towards their re-measure (`idle_steps`)."""
        drafting = set() if lengths is None else {n for n, m in zip(adapters, lengths) if m}
        for name in set(adapters) - drafting:
            self.adapter(name).idle_steps += 1

    # ------------------------------------------------------------ the cost model
    def draft_lengths(self, adapters: list[str], caps: list[int], batch: int,
                      left: list[int] | None = None, ride: list[bool] | None = None) -> list[int]:
        """Per adapter sequence, a draft length in 0..min(k, cap).

        For each M in 1..k every adapter first drafts M, none if it rides (`ride`, see `rides`: it decodes in the
        M passes), or one token if its acceptance is below `min_acceptance` (its first draft costs one verify
        token and keeps its estimate current); then, once the
        verify pass's cost per token is known (two measured sizes), each keeps only the drafts that repay their
        verify tokens, and at least one: its j-th draft adds a^j expected tokens for one more verify token, worth
        it while a^j >= rate x seconds per verify token (rate: the cycle's predicted tokens per second). M
        maximises the predicted rate. With nothing measured yet, M = 1: the cheapest cycle that measures both
        pass kinds.

        `left` (each sequence's tokens to go) marks a closed batch: nothing waits to join it, so it is done when
        its slowest sequence is. With a laggard among them (`_estimates`), the rate is the batch's tokens over the
        time its slowest sequence takes, and no draft is pruned: priced by tokens per second alone, a batch of
        mixed adapters keeps cycling for its fast ones while its slow ones fall behind and then finish alone."""
        k = self.cfg.num_draft_tokens
        self._choice = None
        if not self.cfg.gate:
            return [min(k, c) for c in caps]
        ride = ride or [False] * len(adapters)
        riding = _riding(adapters, ride)
        accs, slowest = self._estimates(adapters, left)
        low = [a < self.cfg.min_acceptance for a in accs]

        def lengths(passes: int) -> list[int]:
            return [0 if r else min(1 if lo else passes, cap) for r, lo, cap in zip(ride, low, caps)]

        if self.probe_due():
            return lengths(1)  # a long run of plain steps re-measures drafting with the cheapest cycle
        num_base = batch - len(adapters)
        distinct = len(set(adapters))
        # The same inputs give the same lengths: in a run of plain steps (where only plain's price moves) the
        # search below would otherwise be paid again every step.
        key = (tuple(accs), tuple(caps), batch, distinct, self.times.version, slowest and tuple(slowest), tuple(ride))
        if self._search is not None and self._search[0] == key:
            self._choice = (adapters, *self._search[1])
            return self._choice[1]
        best, best_rate = lengths(1), None
        for passes in range(1, k + 1):
            cand = lengths(passes)
            rate = self._rate(accs, cand, num_base, distinct, slowest, ride, riding)
            if rate is None:
                continue
            per_token = self.times.slope("lora", sum(cand) + len(cand) + num_base, distinct)
            if per_token > 0 and passes > 1 and left is None:  # (a closed batch waits for its slowest: keep drafts)
                worth = rate * per_token
                pruned = [min(m, max(1, useful_drafts(a, worth))) if m > 1 else m for m, a in zip(cand, accs)]
                if pruned != cand:
                    cand, rate = pruned, self._rate(accs, pruned, num_base, distinct, None, ride, riding)
            if best_rate is None or rate > best_rate:
                best, best_rate = cand, rate
        self._search = (key, (best, best_rate, slowest))
        self._choice = (adapters, best, best_rate, slowest)
        return best

    def _estimates(self, adapters: list[str], left: list[int] | None) -> tuple[list[float], list[int] | None]:
        """Each sequence's acceptance (its adapter's estimate), and `left` again if the closed batch is priced by
        its slowest sequence (`_rate`), else None. That takes a laggard: an estimate, pulled towards the batch's
        pooled one by SHRINK_DRAFTS judged drafts, still LAGGARD below it, once every adapter has EVIDENCE judged
        drafts. Without the shrinkage the slowest of many estimates of one acceptance is low by chance, and
        without the evidence bar one unlucky first draft prices the batch."""
        accs = [self.adapter(n) for n in adapters]
        if not left or min(a.judged_weight for a in accs) < self.EVIDENCE:
            return [a.ema for a in accs], None
        pooled = sum(a.accepted_weight for a in accs) / sum(a.judged_weight for a in accs)
        k = self.SHRINK_DRAFTS
        shrunk = [(a.accepted_weight + k * pooled) / (a.judged_weight + k) for a in accs]
        if min(shrunk) > pooled - self.LAGGARD:
            return [a.ema for a in accs], None
        return shrunk, left

    def adapter_on_time(self, tokens: int, distinct: int) -> float | None:
        """An adapter-on pass of `tokens` tokens: from the verify passes measured (`StepTimes.get`), else, before
        any cycle, the nearest plain step (optimistic for a larger pass: a decision it drives measures the size).
        A plain step is not used once verify passes are measured: its time includes host work that the cycle's
        overhead already counts."""
        t = self.times.get("lora", tokens, distinct)
        return t if t is not None else self.times.get("plain", tokens, distinct)

    def predicted_rate(self, adapters: list[str], lengths: list[int], num_base: int) -> float | None:
        """Tokens per second of a cycle with these draft lengths (None: a pass kind never measured)."""
        return self._rate([self.adapter(a).ema for a in adapters], lengths, num_base, len(set(adapters)))

    def _rate(self, accs: list[float], lengths: list[int], num_base: int, distinct: int,
              slowest: list[int] | None = None, ride: list[bool] | None = None, riding: int = 0) -> float | None:
        """predicted_rate's arithmetic. `slowest`: a closed batch's tokens to go, when its slowest sequence prices
        it (`_estimates`): the batch's tokens over the time that sequence takes at this cycle. `ride`: which
        adapter sequences ride (a token per pass, like a base-only one), `riding` their distinct adapters, which
        the drafting passes then read (priced as base passes with that many adapters)."""
        passes = max(lengths, default=0)
        if not passes:
            return None
        batch = len(accs) + num_base
        t_base = self.times.get("base", batch, riding)
        t_verify = self.adapter_on_time(sum(lengths) + len(lengths) + num_base, distinct)
        if t_base is None or t_verify is None:
            return None
        t_over = self.times.get("overhead", batch, 0) or 0.0
        t_cycle = t_over + passes * t_base + t_verify
        gains = [passes + 1.0 if r else expected_tokens(a, m) for a, m, r in zip(accs, lengths, ride or [False] * len(accs))]
        if slowest:
            return sum(slowest) / (max(n / g for n, g in zip(slowest, gains)) * t_cycle)
        return (sum(gains) + num_base * (passes + 1)) / t_cycle

    def decide(self, adapters: list[str], lengths: list[int], num_base: int, caps: list[int] | None = None,
               left: list[int] | None = None, ride: list[bool] | None = None, prompts: int = 0) -> bool:
        """True: run a speculative cycle with these draft lengths (one per adapter sequence);
        False: a plain multi-LoRA step. `num_base`: base-only sequences decoding beside them; `prompts`: prompts
        in the step's batch."""
        batch, distinct = len(adapters) + num_base, len(set(adapters))
        self.last_margin = None
        if not self.cfg.gate:
            forced = any(lengths)
            self.count(Decision.SPECULATE_FORCED if forced else Decision.PLAIN_NOTHING_TO_DRAFT, "gate disabled")
            return forced
        if not any(lengths):
            if caps is not None and not any(caps):
                self.count(Decision.PLAIN_NOTHING_TO_DRAFT, "every sequence is one token from its end")
            elif all(self.adapter(a).ema < self.cfg.min_acceptance for a in adapters):
                self.count(Decision.PLAIN_LOW_ACCEPTANCE, "every adapter's acceptance is below the drafting threshold")
            else:
                self.count(Decision.PLAIN_COST, "no draft length repays its base passes at the measured costs")
            return False
        if self.probe_due():
            self.count(Decision.SPECULATE_PROBE, f"{self.plain_streak} plain steps in a row: re-measure drafting")
            return True
        # Plain is priced only from plain steps of this batch size: a batch size not measured yet is measured by
        # one plain step (priced from another size or an adapter-on pass, plain would look dearer than it is).
        t_plain = self.times.get("plain", batch, distinct, exact=True)
        if self._choice is not None and self._choice[0] == adapters and self._choice[1] == lengths:
            spec_rate, slowest = self._choice[2], self._choice[3]  # the rate draft_lengths priced these lengths at
        else:
            accs, slowest = self._estimates(adapters, left)
            spec_rate = self._rate(accs, lengths, num_base, distinct, slowest, ride, _riding(adapters, ride or []))
        if spec_rate is None:
            self.count(Decision.SPECULATE_EXPLORE, "no base-only or adapter-on pass measured yet")
            return True
        if t_plain is None and prompts:
            # A plain step with prompts in it is not timed (`observe`), so exploring would measure nothing (under
            # steady arrivals most steps have a prompt): the sizes measured around this one price it instead.
            t_plain = self.times.get("plain", batch, distinct)
            if t_plain is None:
                self.count(Decision.SPECULATE_EXPLORE, "no plain step measured yet, and this one would not be timed")
                return True
        if t_plain is None:
            self.count(Decision.PLAIN_EXPLORE, "plain step time at this batch not measured yet")
            return False
        plain_rate = sum(slowest) / (max(slowest) * t_plain) if slowest else (len(lengths) + num_base) / t_plain
        if spec_rate > plain_rate:
            self.count(Decision.SPECULATE, f"{spec_rate:.1f} tok/s speculative > {plain_rate:.1f} tok/s plain")
            return True
        self.count(Decision.PLAIN_COST, f"{spec_rate:.1f} tok/s speculative <= {plain_rate:.1f} tok/s plain")
        self.last_margin = plain_rate / spec_rate - 1.0
        return False

    def count(self, decision: Decision | str, why: str) -> None:
        """Record a decision; it drives the probe back-off and the plain streak."""
        decision = Decision(decision)
        self.counters.gate_decisions[decision.value] += 1
        if decision is Decision.SPECULATE_PROBE:
            self._probed = True
        elif decision.speculates:
            self._probed, self.probe_backoff = False, 1
        elif self._probed and decision in (Decision.PLAIN_LOW_ACCEPTANCE, Decision.PLAIN_COST):  # the probe lost
            self._probed, self.probe_backoff = False, min(self.MAX_PROBE_BACKOFF, 2 * self.probe_backoff)
        self.plain_streak = 0 if decision.speculates else self.plain_streak + 1
        logger.debug("gate: %s (%s)", decision.value, why)

    @property
    def decisions(self):
        return self.counters.gate_decisions


def _riding(adapters: list[str], ride: list[bool]) -> int:
    """Distinct adapters among the riding sequences."""
    return len({a for a, r in zip(adapters, ride) if r})
