"""When drafting pays: per step, a plan (plain step or speculative cycle, and each sequence's draft length)
from a cost model fed by measured pass times and per-adapter acceptance.

The arithmetic is pricing.py's (pure functions); this holds the state it reads: measured pass times, per-adapter
acceptance, probes and holds. Plain steps are priced by the wall time of a whole engine step (host work the device
does not hide included, which a plain step pays per token and a cycle once)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from ..config import SpecConfig
from ..scheduler import ScheduledBatch
from ..sequence import Sequence
from ..stats import EngineStats, SpecStats
from . import pricing
from .acceptance import AdapterAcceptance
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
    PLAIN_PROBE = "plain_probe"  # a long run of cost-priced cycles: re-measure plain

    @property
    def speculates(self) -> bool:
        return self in _SPECULATE


_SPECULATE = {Decision.SPECULATE, Decision.SPECULATE_FORCED, Decision.SPECULATE_PROBE, Decision.SPECULATE_EXPLORE}


@dataclass
class Plan:
    """What one engine step runs. Per-sequence lists are aligned with `seqs`."""

    seqs: list[Sequence] = field(default_factory=list)  # the scheduled batch
    speculate: bool = False
    lengths: list[int] = field(default_factory=list)  # per sequence: its draft length (0: it drafts nothing)
    # Per sequence: it decodes in every drafting pass, each pass a plain step for it: a base-only one, or an adapter
    # one that rides (Gate.rides) with its adapter on in those passes instead of drafting
    ride: list[bool] = field(default_factory=list)
    decoding: int = 0  # sequences decoding (the rest are prefills)
    distinct: int = 0  # distinct adapters among the decoding sequences
    timed: bool = True  # False while the step may capture CUDA graphs: its times are no pass's
    remeasure: bool = False  # a plain probe: its time replaces the plain step time measured before at its size
    # How many tokens a prompt computed in one of the cycle's drafting passes may draft in the passes after it
    # (Gate.prompt_drafts; the planner caps it by the passes left and the tokens it may still generate)
    prompt_drafts: Callable[[Sequence], int] = field(default=lambda s: 0, repr=False)

    @property
    def passes(self) -> int:
        """Drafting passes: the longest draft (0: a plain step)."""
        return max(self.lengths, default=0) if self.speculate else 0


@dataclass
class StepResult:
    """What a step measured and verified, for the gate (`Gate.observe`).

    `passes`: every forward the step ran, in order, as (kind, tokens, adapters, device seconds): "plain" for a
    plain step's one forward, "base" / "lora" / "prompted" for a cycle's. Device seconds are the forward's own span
    on the device timeline (CUDA events around it; on a CPU, where forwards are synchronous, its wall time).
    `host_s`: the host's own work for the step (scheduling, packing, launching, reading), device waits excluded;
    in the overlapped loop a step costs about max(device, host)."""

    passes: list[tuple[str, int, int, float]] = field(default_factory=list)  # (kind, tokens, adapters, seconds)
    verifies: list[tuple[str, int, int]] = field(default_factory=list)  # (adapter, drafted, accepted)
    host_s: float = 0.0


class NoSpeculation:
    """The plan source when speculation is off: every step is plain, with no drafting room."""

    lookahead = 0

    def plan(self, batch: ScheduledBatch) -> Plan:
        return Plan(seqs=batch.seqs, lengths=[0] * len(batch.seqs), ride=[False] * len(batch.seqs))

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
        # Consecutive cycles the cost model chose over a plain step and its back-off: a plain probe refreshes the
        # plain step time, which is measured only in plain steps (one measured high would keep the gate drafting)
        self.spec_streak, self.plain_probe_backoff = 0, 1
        self._plain_probed = False  # a plain probe's time is recorded, and no cost decision since has judged it
        self.last_decision: Decision | None = None
        self.last_margin: float | None = None  # how much faster plain was priced, when decide chose plain on cost
        self._probed = False  # the last cycle was a probe, and no decision since has judged it
        self._reserve = True  # reserve drafting room at the next schedule
        # plain steps left without re-pricing, and the batch they hold for: its adapters, sequences, summed draft caps
        self._hold, self._hold_batch = 0, (frozenset(), 0, 0)

    # ------------------------------------------------------------ the step
    @property
    def lookahead(self) -> int:
        """Drafting room to reserve at this step's scheduling: none after a step found every adapter gated off
        or chose plain by a wide margin, until a step could draft again."""
        return self.cfg.num_draft_tokens if self._reserve else 0

    def plan(self, batch: ScheduledBatch) -> Plan:
        seqs = batch.seqs
        decoding = [not s.is_prefill for s in seqs]
        lora = [s for s, d in zip(seqs, decoding) if d and s.adapter is not None]
        names = [s.adapter for s in lora]
        plan = Plan(seqs=seqs, lengths=[0] * len(seqs), ride=[d and s.adapter is None for s, d in zip(seqs, decoding)],
                    decoding=sum(decoding), distinct=len(set(names)), timed=not self.capturing())
        if batch.empty:
            return plan
        ride = [self.rides(s) for s in lora]
        lengths = self._choose(lora, names, plan.decoding, plan.decoding - len(lora), batch, ride)
        self.note_step(names, lengths)
        if lengths is None:
            self.counters.plain_steps += 1
            plan.remeasure = self.last_decision is Decision.PLAIN_PROBE
            return plan
        self.counters.cycles += 1
        chosen: dict[str, int] = {}
        for name, m in zip(names, lengths):
            chosen[name] = max(m, chosen.get(name, 0))
        at = iter(zip(lengths, ride))
        for i, (s, d) in enumerate(zip(seqs, decoding)):
            if d and s.adapter is not None:
                plan.lengths[i], plan.ride[i] = next(at)
        plan.speculate = True
        plan.prompt_drafts = lambda s: self.prompt_drafts(s, chosen)
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
        caps = [self._cap(s) for s in lora]
        if self._hold and self.holds_for(names, caps) and not self.probe_due():
            self._hold -= 1
            self.count(Decision.PLAIN_HOLD, "a recent cost decision chose plain for this batch by a wide margin")
            self._reserve = not self._hold
            return None
        if not batch.lookahead:
            self.count(Decision.PLAIN_UNRESERVED, "no drafting room reserved this step")
            self._reserve = True
            return None
        left = [s.tokens_left(self.max_model_len) for s in lora] if batch.closed else None
        lengths = self.draft_lengths(names, caps, decoding, left, ride)
        speculate = self.decide(names, lengths, num_base, caps, left, ride, prompts=len(batch.seqs) - decoding)
        self._hold = 0 if speculate else self.hold_steps()
        self._hold_batch = (frozenset(names), len(caps), sum(caps))
        self._reserve = not self._hold
        return lengths if speculate else None

    def observe(self, plan: Plan, result: StepResult, seconds: float) -> None:
        """After the step is read (`seconds`: its whole time, from its scheduling to the next step's):
        per-adapter acceptance from the verify pass, and pass times: each measured pass, then the rest of a cycle's
        step as its overhead, or a decode-only plain step at its whole time (a step with prompts in it prices no
        plain decoding)."""
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
            self.times.record("plain", plan.decoding, plan.distinct, seconds, replace=plan.remeasure)
            self._plain_probed |= plan.remeasure

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

    def plain_probe_due(self, prompts: int) -> bool:
        """A plain step is due to re-measure plain decoding: `base_probe_interval` cycles chosen on cost in a row,
        times a back-off that doubles after every plain probe the gate answers with a cycle again (up to
        MAX_PROBE_BACKOFF), back to 1 once plain wins. Not in a step with prompts, which would not be timed."""
        interval = self.base_probe_interval * self.plain_probe_backoff
        return bool(interval) and not prompts and self.spec_streak >= interval

    def hold_steps(self) -> int:
        """After decide(): how many plain steps of the same batch may follow without re-pricing. None unless the
        last decision was plain on cost, then one per 2% by which plain beat the best cycle, at most MAX_HOLD."""
        if self.last_margin is None:
            return 0
        return min(self.MAX_HOLD, int(self.last_margin / 0.02))

    HOLD_SPREAD = 4 / 3  # how far the batch may grow or shrink (either way) and still be held
    HOLD_CAP_SLACK = 1.1  # how much more drafting room per sequence than priced it may have and still be held

    def holds_for(self, names: list[str], caps: list[int]) -> bool:
        """A hold applies to the batch it was priced for and to the batches the same decision prices alike: no
        adapter it was not priced with (one might draft well), within HOLD_SPREAD of its size, and no more room to
        draft per sequence than it had (a batch priced near its sequences' ends would draft little). At a burst,
        sequences join and finish at nearly every step; re-pricing each time would cost a step without drafting
        room (PLAIN_UNRESERVED) before every new decision."""
        held, size, room = self._hold_batch
        if not set(names) <= held or not size / self.HOLD_SPREAD <= len(caps) <= size * self.HOLD_SPREAD:
            return False
        return sum(caps) * size <= room * len(caps) * self.HOLD_CAP_SLACK

    def note_step(self, adapters: list[str], lengths: list[int] | None) -> None:
        """After a step: the adapters that drafted nothing in it (every one, in a plain step; in a cycle, one whose
        sequences were a token from their end) count it towards their re-measure (`idle_steps`)."""
        drafting = set() if lengths is None else {n for n, m in zip(adapters, lengths) if m}
        for name in set(adapters) - drafting:
            self.adapter(name).idle_steps += 1

    # ------------------------------------------------------------ the cost model
    def draft_lengths(self, adapters: list[str], caps: list[int], batch: int,
                      left: list[int] | None = None, ride: list[bool] | None = None) -> list[int]:
        """Per adapter sequence, a draft length in 0..min(k, cap) (pricing.best_lengths; with the gate off, k; when a
        probe is due, 1: a long run of plain steps re-measures drafting with the cheapest cycle).

        `left` (each sequence's tokens to go) marks a closed batch: nothing waits to join it, so it is done when
        its slowest sequence is. With a laggard among them (`_estimates`), the rate is the batch's tokens over the
        time its slowest sequence takes, and no draft is pruned: priced by tokens per second alone, a batch of
        mixed adapters keeps cycling for its fast ones while its slow ones fall behind and then finish alone."""
        k = self.cfg.num_draft_tokens
        if not self.cfg.gate:
            return [min(k, c) for c in caps]
        priced = self._batch(adapters, caps, batch - len(adapters), left, ride)
        if self.probe_due():
            return pricing.lengths_for(priced, 1, self.cfg.min_acceptance)
        return pricing.best_lengths(self.times, priced, k, self.cfg.min_acceptance)[0]

    def _batch(self, adapters: list[str], caps: list[int] | None, num_base: int, left: list[int] | None,
               ride: list[bool] | None) -> pricing.Batch:
        ride = ride or [False] * len(adapters)
        accs, slowest = self._estimates(adapters, left)
        return pricing.Batch(tuple(accs), tuple(caps or [self.cfg.num_draft_tokens] * len(adapters)), tuple(ride),
                             num_base, len(set(adapters)), _riding(adapters, ride), closed=left is not None,
                             slowest=tuple(slowest) if slowest else None)

    def _estimates(self, adapters: list[str], left: list[int] | None) -> tuple[list[float], list[int] | None]:
        """Each sequence's acceptance (its adapter's estimate), and `left` again if the closed batch is priced by
        its slowest sequence (`pricing.cycle_rate`), else None. That takes a laggard: an estimate, pulled towards the
        batch's pooled one by SHRINK_DRAFTS judged drafts, still LAGGARD below it, once every adapter has EVIDENCE
        judged drafts. Without the shrinkage the slowest of many estimates of one acceptance is low by chance, and
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

    def predicted_rate(self, adapters: list[str], lengths: list[int], num_base: int) -> float | None:
        """Tokens per second of a cycle with these draft lengths (None: a pass kind never measured)."""
        return pricing.cycle_rate(self.times, self._batch(adapters, None, num_base, None, None), lengths)

    def decide(self, adapters: list[str], lengths: list[int], num_base: int, caps: list[int] | None = None,
               left: list[int] | None = None, ride: list[bool] | None = None, prompts: int = 0) -> bool:
        """True: run a speculative cycle with these draft lengths (one per adapter sequence);
        False: a plain multi-LoRA step. `num_base`: base-only sequences decoding beside them; `prompts`: prompts
        in the step's batch."""
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
        priced = self._batch(adapters, caps, num_base, left, ride)
        batch, distinct = len(adapters) + num_base, priced.distinct
        # Plain is priced only from plain steps of this batch size: a batch size not measured yet is measured by
        # one plain step (priced from another size or an adapter-on pass, plain would look dearer than it is).
        t_plain = self.times.get("plain", batch, distinct, exact=True)
        spec_rate = pricing.cycle_rate(self.times, priced, lengths)
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
        plain_rate = pricing.plain_rate(priced, t_plain)
        if spec_rate > plain_rate and self.plain_probe_due(prompts):
            self.count(Decision.PLAIN_PROBE, f"{self.spec_streak} cycles in a row on cost: re-measure plain")
            return False
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
        if self._plain_probed and decision in (Decision.SPECULATE, Decision.PLAIN_COST):
            lost = decision is Decision.SPECULATE  # priced with the fresh plain time, the cycle still wins
            self.plain_probe_backoff = min(self.MAX_PROBE_BACKOFF, 2 * self.plain_probe_backoff) if lost else 1
            self._plain_probed = False
        self.spec_streak = self.spec_streak + 1 if decision is Decision.SPECULATE else 0
        self.last_decision = decision
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
