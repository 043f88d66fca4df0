"""When drafting pays: per step, a plan (plain step or speculative cycle, and each sequence's draft length).

`Gate` is the stateful shell the engine calls: it turns a scheduled batch into the policy's input, keeps the
policy's state (policy.py: `decide(state, batch, estimates, tuning) -> (choice, state)`, pure) and the estimator
(estimator.py: pass costs as the overlapped loop spends them, per-adapter acceptance), feeds the estimator each
step's measurements (`StepResult`) and counts the decisions."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import SpecConfig
from ..scheduler import ScheduledBatch
from ..sequence import Sequence
from ..stats import EngineStats, SpecStats
from . import policy, pricing
from .acceptance import AdapterAcceptance
from .cost import StepTimes
from .estimator import Estimator
from .policy import Decision

logger = logging.getLogger(__name__)


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
    in the overlapped loop a step costs about max(device, host). `period_s`: what the loop spent on it, idle
    included: from the end of the step before it (queued when it was) to its own end, on the device timeline (0:
    not measured, as when the step before had been read first)."""

    passes: list[tuple[str, int, int, float]] = field(default_factory=list)  # (kind, tokens, adapters, seconds)
    verifies: list[tuple[str, int, int]] = field(default_factory=list)  # (adapter, drafted, accepted)
    host_s: float = 0.0
    period_s: float = 0.0


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
    says whether the next forward may still capture CUDA graphs (a step that does is not timed); `probe_interval`:
    plain steps before a probe cycle, and cycles before a plain probe (policy.Tuning)."""

    def __init__(self, cfg: SpecConfig, probe_interval: int = 64, max_model_len: int = 1 << 30,
                 capturing: Callable[[], bool] = lambda: False, stats: EngineStats | None = None):
        self.cfg = cfg
        self.max_model_len = max_model_len
        self.capturing = capturing
        self.stats = stats or EngineStats()
        if self.stats.spec is None:
            self.stats.spec = SpecStats(cfg.num_draft_tokens)
        self.counters: SpecStats = self.stats.spec
        self.tuning = policy.Tuning(cfg.num_draft_tokens, cfg.min_acceptance, probe_interval)
        self.estimator = Estimator(cfg.initial_acceptance, cfg.acceptance_ema)
        self.state: policy.State = policy.Explore()
        self.last_decision: Decision | None = None
        self._probe: Plan | None = None  # the probe cycle planned last, until it is read

    # ------------------------------------------------------------ the step
    @property
    def lookahead(self) -> int:
        """Drafting room to reserve at this step's scheduling: none while a plain hold lasts or after a step found
        every adapter gated off, until a step could draft again (policy.reserves)."""
        reserve = not self.cfg.gate or policy.reserves(self.state)
        return self.cfg.num_draft_tokens if reserve else 0

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
        choice = self._choose(lora, names, plan.decoding, batch, ride)
        self.note_step(names, None if choice.lengths is None else list(choice.lengths))
        if choice.lengths is None:
            self.counters.plain_steps += 1
            plan.remeasure = choice.remeasure
            return plan
        self.counters.cycles += 1
        self._speculative(plan, decoding, list(choice.lengths), ride)
        if choice.decision is Decision.SPECULATE_PROBE:
            self._probe = plan
        return plan

    def _speculative(self, plan: Plan, decoding: list[bool], lengths: list[int], ride: list[bool]) -> None:
        """Fill a cycle's plan: each adapter sequence's draft length and whether it rides."""
        chosen: dict[str, int] = {}
        at = iter(zip(lengths, ride))
        for i, (s, d) in enumerate(zip(plan.seqs, decoding)):
            if d and s.adapter is not None:
                plan.lengths[i], plan.ride[i] = next(at)
                chosen[s.adapter] = max(plan.lengths[i], chosen.get(s.adapter, 0))
        plan.speculate = True
        plan.prompt_drafts = lambda s: self.prompt_drafts(s, chosen)

    def _choose(self, lora: list[Sequence], names: list[str], decoding: int, batch: ScheduledBatch,
                ride: list[bool]) -> policy.Choice:
        """The policy's choice for the adapter sequences (with the gate off, every one drafts what it can)."""
        if not lora:
            return policy.Choice(None)
        caps = [self._cap(s) for s in lora]
        if not self.cfg.gate:
            lengths = self.draft_lengths(names, caps, decoding)
            forced = any(lengths) and bool(batch.lookahead)
            choice = policy.Choice(Decision.SPECULATE_FORCED, tuple(lengths)) if forced else policy.Choice(
                Decision.PLAIN_NOTHING_TO_DRAFT if batch.lookahead else Decision.PLAIN_UNRESERVED)
        else:
            left = tuple(s.tokens_left(self.max_model_len) for s in lora) if batch.closed else None
            view = policy.Decoding(tuple(names), tuple(caps), tuple(ride), decoding - len(lora),
                                   len(batch.seqs) - decoding, left, reserved=bool(batch.lookahead))
            choice, self.state = policy.decide(self.state, view, self.estimator, self.tuning)
        self.count(choice.decision)
        return choice

    def observe(self, plan: Plan, result: StepResult, seconds: float) -> None:
        """After the step is read (`seconds`: its whole time, from its scheduling to the next step's): acceptance
        from its verify pass and its pass and host times to the estimator; a probe's measurement to the policy."""
        for name, drafted, accepted in result.verifies:
            self.stats.adapter(name).observe_verify(drafted, accepted)
        # a step planned while CUDA graphs could be captured, read once they are not: it captured them
        timed = plan.timed or self.capturing()
        recorded = self.estimator.observe(plan, result, seconds, timed)
        if plan is self._probe:
            self._probe, self.state = None, policy.measured(self.state, "cycle")
        elif plan.remeasure and recorded:
            self.state = policy.measured(self.state, "plain")

    def estimates(self) -> dict[str, float]:
        return {name: a.ema for name, a in self.estimator.adapters.items()}

    def _cap(self, s: Sequence) -> int:
        """Longest useful draft: every accepted token plus the target's own must fit the sequence's end. A request
        whose params rule drafting out (SamplingParams.can_draft) drafts nothing: the verify pass is its plain step."""
        if not s.params.can_draft:
            return 0
        return max(0, min(self.cfg.num_draft_tokens, s.tokens_left(self.max_model_len) - 1))

    # ------------------------------------------------------------ per sequence
    def prompt_drafts(self, s: Sequence, chosen: dict[str, int]) -> int:
        """Drafts for a prompt computed in a drafting pass, in the passes after it: none when it is base-only (it
        rides: the drafting passes are its own model), its params rule drafting out or its adapter rides; else the
        longest draft `chosen` for its adapter's sequences in this plan, or, for an adapter the plan has none of,
        one token below min_acceptance (as draft_lengths gives it) and no limit otherwise."""
        if s.adapter is None or not s.params.can_draft or self.rides(s):
            return 0
        if s.adapter in chosen:
            return chosen[s.adapter]
        return 1 if self.cfg.gate and self.estimator.acceptance(s.adapter) < self.cfg.min_acceptance else 1 << 30

    def rides(self, s: Sequence) -> bool:
        """An adapter sequence decodes in the drafting passes with its adapter on (a token per pass, as a base-only
        sequence does) instead of drafting, when its adapter's acceptance is below min_acceptance: drafting would
        give it about one token per cycle, as slow as the cycle is long, where riding gives one per pass. Its
        adapter is re-measured (one draft) once it has ridden `probe_interval` steps. Not with the gate off."""
        if not self.cfg.gate or not s.params.can_draft:
            return False
        est = self.estimator
        return policy.rides(self.state, est.acceptance(s.adapter), est.idle_steps(s.adapter), self.tuning)

    def note_step(self, adapters: list[str], lengths: list[int] | None) -> None:
        self.estimator.note_idle(adapters, lengths)

    # ------------------------------------------------------------ the cost model, for callers and tests
    def draft_lengths(self, adapters: list[str], caps: list[int], batch: int,
                      left: list[int] | None = None, ride: list[bool] | None = None) -> list[int]:
        """Per adapter sequence, a draft length in 0..min(k, cap) (policy.draft_lengths; with the gate off, k).
        `batch`: sequences decoding; `left`: each one's tokens to go, for a closed batch."""
        if not self.cfg.gate:
            return [min(self.cfg.num_draft_tokens, c) for c in caps]
        view = self._view(adapters, caps, batch, left, ride)
        return policy.draft_lengths(self.state, policy.priced_batch(view, self.estimator), self.estimator,
                                    self.tuning)

    def predicted_rate(self, adapters: list[str], lengths: list[int], num_base: int) -> float | None:
        """Tokens per second of a cycle with these draft lengths (None: a pass kind never measured)."""
        view = self._view(adapters, [self.cfg.num_draft_tokens] * len(adapters), len(adapters) + num_base)
        return pricing.cycle_rate(self.estimator, policy.priced_batch(view, self.estimator), lengths)

    @staticmethod
    def _view(adapters: list[str], caps: list[int], batch: int, left: list[int] | None = None,
              ride: list[bool] | None = None) -> policy.Decoding:
        return policy.Decoding(tuple(adapters), tuple(caps), tuple(ride or [False] * len(adapters)),
                               batch - len(adapters), left=tuple(left) if left else None)

    # ------------------------------------------------------------ state the engine and tests read
    def adapter(self, name: str) -> AdapterAcceptance:
        return self.estimator.adapter(name)

    @property
    def times(self) -> StepTimes:
        return self.estimator.times

    @property
    def probe_interval(self) -> int:
        return policy.probe_interval(self.state, self.tuning)

    def count(self, decision: Decision | None, why: str = "") -> None:
        """Record a decision (None: none was taken)."""
        if decision is None:
            return
        self.counters.gate_decisions[decision.value] += 1
        self.last_decision = decision
        logger.debug("gate: %s -> %s %s", decision.value, self.state.name, why)

    @property
    def decisions(self):
        return self.counters.gate_decisions
