"""The gate's policy, pure: per step a plain step or a speculative cycle with each sequence's draft length, from the
gate's state, the decoding batch and the estimator's costs and acceptance:

    decide(state, batch, estimates, tuning) -> (choice, next state)

The states (frozen; `gate.Gate` keeps the current one):
- Explore: the start, and after a step chosen to measure a pass kind or batch size not measured yet;
- Speculate: cycles chosen on cost (`cycle_run` in a row: a plain probe is due after probe_interval of them);
- Plain: plain steps (on cost, low acceptance, no drafting room, nothing to draft); `room`: reserve drafting room
  at the next scheduling;
- Hold: plain steps without re-pricing, `left` more, for batches priced alike (`HoldKey`), after a plain decision
  by a wide margin (no drafting room is reserved meanwhile);
- Probe: the step re-measures the side that keeps losing: a cycle after probe_interval plain steps in a row, a
  plain step after probe_interval cycles chosen on cost in a row.
Every state carries the run lengths probes are due after, and the probes' back-offs (`Probes`): a probe the next
decision answers as before doubles the wait for the next one (up to max_backoff), one that changes it resets it.
A probe is judged once its measurement is read (`measured`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Protocol

from . import pricing


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


@dataclass(frozen=True)
class Tuning:
    """The policy's constants. probe_interval 0: never probe (nor re-measure a riding adapter)."""

    num_draft_tokens: int = 4
    min_acceptance: float = 0.3
    probe_interval: int = 64
    max_backoff: int = 8
    max_hold: int = 16  # plain steps of one batch without re-pricing, after a wide-margin plain decision
    hold_per_margin: float = 0.02  # one held step per this much by which plain beat the best cycle
    hold_spread: float = 4 / 3  # how far a held batch may grow or shrink (either way) and still be held
    hold_cap_slack: float = 1.1  # how much more drafting room per sequence than priced it may have and be held


@dataclass(frozen=True)
class Decoding:
    """The decoding batch a step decides for: per adapter sequence its adapter, longest useful draft (`caps`) and
    whether it rides; base-only sequences beside them; prompts in the step; a closed batch's tokens to go per
    adapter sequence (`left`; None: the batch is open); whether drafting room was reserved at its scheduling."""

    adapters: tuple[str, ...]
    caps: tuple[int, ...]
    ride: tuple[bool, ...]
    num_base: int = 0
    prompts: int = 0
    left: tuple[int, ...] | None = None
    reserved: bool = True

    @property
    def size(self) -> int:
        return len(self.adapters) + self.num_base


class Estimates(pricing.Costs, Protocol):
    """What the policy reads of the estimator (estimator.Estimator): pass costs and per-adapter acceptance."""

    def acceptance(self, name: str) -> float: ...

    def idle_steps(self, name: str) -> int: ...

    def batch_acceptance(self, adapters: tuple[str, ...], left: tuple[int, ...] | None
                         ) -> tuple[list[float], tuple[int, ...] | None]: ...


@dataclass(frozen=True)
class Probes:
    """The probes' back-offs (each multiplies probe_interval) and the probes measured but not judged yet."""

    cycle_backoff: int = 1  # plain steps before a probe cycle
    plain_backoff: int = 1  # cycles chosen on cost before a plain probe
    judging: frozenset[str] = frozenset()  # "cycle" / "plain": measured, judged by the next cost decision


@dataclass(frozen=True, kw_only=True)
class State:
    probes: Probes = field(default_factory=Probes)
    plain_run: int = 0  # plain steps since the last cycle
    cycle_run: int = 0  # cycles chosen on cost in a row

    @property
    def name(self) -> str:
        return type(self).__name__.lower()


@dataclass(frozen=True, kw_only=True)
class Explore(State):
    pass


@dataclass(frozen=True, kw_only=True)
class Speculate(State):
    pass


@dataclass(frozen=True, kw_only=True)
class Plain(State):
    room: bool = True


@dataclass(frozen=True)
class HoldKey:
    """The batch a hold was priced for: its adapters, sequences and summed draft caps."""

    adapters: frozenset[str]
    size: int
    room: int


@dataclass(frozen=True, kw_only=True)
class Hold(State):
    left: int
    key: HoldKey


@dataclass(frozen=True, kw_only=True)
class Probe(State):
    kind: str  # "cycle" or "plain"


@dataclass(frozen=True)
class Choice:
    """What a step runs: `lengths` per adapter sequence (None: a plain step), and the decision that chose it (None:
    nothing to decide, no adapter sequence decodes)."""

    decision: Decision | None
    lengths: tuple[int, ...] | None = None

    @property
    def remeasure(self) -> bool:
        """A plain probe: its time replaces the plain step time measured before at its size."""
        return self.decision is Decision.PLAIN_PROBE


# ------------------------------------------------------------ the decision
def decide(state: State, batch: Decoding, est: Estimates, tune: Tuning) -> tuple[Choice, State]:
    """The step's choice and the state after it (the gate is on: with it off every step drafts, gate.Gate)."""
    if not batch.adapters:
        return Choice(None), state
    if gated_off(state, batch.adapters, est, tune):
        return _plain(state, Decision.PLAIN_LOW_ACCEPTANCE, tune, room=False)
    if isinstance(state, Hold) and holds(state.key, batch, tune) and not probe_due(state, tune):
        return _held(state)
    if not batch.reserved:
        return _plain(state, Decision.PLAIN_UNRESERVED, tune)
    priced = priced_batch(batch, est)
    lengths = draft_lengths(state, priced, est, tune)
    if not any(lengths):
        return _plain(state, _nothing_drafts(batch, priced, tune), tune)
    if probe_due(state, tune):
        return _cycle(state, Decision.SPECULATE_PROBE, lengths, tune)
    return _priced(state, batch, priced, lengths, est, tune)


def _priced(state: State, batch: Decoding, priced: pricing.Batch, lengths: list[int], est: Estimates,
            tune: Tuning) -> tuple[Choice, State]:
    """Cycle or plain step by their rates. Plain is priced only from plain steps of this batch size: one not
    measured yet is measured by a plain step (priced from another size, plain would look dearer or cheaper than
    it is), but in a step with prompts, which would not be timed: there the sizes measured around it price it."""
    spec_rate = pricing.cycle_rate(est, priced, lengths)
    t_plain = est.plain(batch.size, priced.distinct, exact=not batch.prompts)
    if spec_rate is None or (t_plain is None and batch.prompts):
        return _cycle(state, Decision.SPECULATE_EXPLORE, lengths, tune)
    if t_plain is None:
        return _plain(state, Decision.PLAIN_EXPLORE, tune)
    plain_rate = pricing.plain_rate(priced, t_plain)
    if spec_rate > plain_rate and plain_probe_due(state, batch.prompts, tune):
        return _plain(state, Decision.PLAIN_PROBE, tune)
    if spec_rate > plain_rate:
        return _cycle(state, Decision.SPECULATE, lengths, tune)
    held = hold_steps(plain_rate / spec_rate - 1.0, tune)
    key = HoldKey(frozenset(batch.adapters), len(batch.caps), sum(batch.caps))
    return _plain(state, Decision.PLAIN_COST, tune, hold=(held, key) if held else None)


def _nothing_drafts(batch: Decoding, priced: pricing.Batch, tune: Tuning) -> Decision:
    """Why no draft length was chosen."""
    if not any(batch.caps):
        return Decision.PLAIN_NOTHING_TO_DRAFT
    if all(a < tune.min_acceptance for a in priced.accs):
        return Decision.PLAIN_LOW_ACCEPTANCE
    return Decision.PLAIN_COST


# ------------------------------------------------------------ transitions
def _cycle(state: State, decision: Decision, lengths: list[int], tune: Tuning) -> tuple[Choice, State]:
    cycles = state.cycle_run + 1 if decision is Decision.SPECULATE else 0
    common = {"probes": _judged(state.probes, decision, tune), "plain_run": 0, "cycle_run": cycles}
    choice = Choice(decision, tuple(lengths))
    if decision is Decision.SPECULATE_PROBE:
        return choice, Probe(kind="cycle", **common)
    if decision is Decision.SPECULATE_EXPLORE:
        return choice, Explore(**common)
    return choice, Speculate(**common)


def _plain(state: State, decision: Decision, tune: Tuning, room: bool = True,
           hold: tuple[int, HoldKey] | None = None) -> tuple[Choice, State]:
    common = {"probes": _judged(state.probes, decision, tune), "plain_run": state.plain_run + 1, "cycle_run": 0}
    if decision is Decision.PLAIN_PROBE:
        return Choice(decision), Probe(kind="plain", **common)
    if decision is Decision.PLAIN_EXPLORE:
        return Choice(decision), Explore(**common)
    if hold is not None:
        return Choice(decision), Hold(left=hold[0], key=hold[1], **common)
    return Choice(decision), Plain(room=room, **common)


def _held(state: Hold) -> tuple[Choice, State]:
    """One held step: plain again without re-pricing; room is reserved for the step after the last."""
    common = {"probes": state.probes, "plain_run": state.plain_run + 1, "cycle_run": 0}
    if state.left > 1:
        return Choice(Decision.PLAIN_HOLD), Hold(left=state.left - 1, key=state.key, **common)
    return Choice(Decision.PLAIN_HOLD), Plain(room=True, **common)


def _judged(probes: Probes, decision: Decision, tune: Tuning) -> Probes:
    """The probes after a decision. A cycle chosen on its merits brings the probe cycles' wait back to the base; a
    measured probe cycle answered with plain (on cost or low acceptance) doubles it. A measured plain probe is judged
    by the next cost decision: a cycle again doubles the plain probes' wait, plain resets it."""
    cycle, plain, judging = probes.cycle_backoff, probes.plain_backoff, probes.judging
    if decision.speculates and decision is not Decision.SPECULATE_PROBE:
        cycle, judging = 1, judging - {"cycle"}
    elif "cycle" in judging and decision in (Decision.PLAIN_COST, Decision.PLAIN_LOW_ACCEPTANCE):
        cycle, judging = min(tune.max_backoff, 2 * cycle), judging - {"cycle"}
    if "plain" in judging and decision in (Decision.SPECULATE, Decision.PLAIN_COST):
        lost = decision is Decision.SPECULATE  # priced with the fresh plain time, the cycle still wins
        plain, judging = (min(tune.max_backoff, 2 * plain) if lost else 1), judging - {"plain"}
    if (cycle, plain, judging) == (probes.cycle_backoff, probes.plain_backoff, probes.judging):
        return probes
    return Probes(cycle, plain, judging)


def measured(state: State, kind: str) -> State:
    """The state once a probe of `kind` ("cycle" or "plain") is read: the next cost decision judges it."""
    return replace(state, probes=replace(state.probes, judging=state.probes.judging | {kind}))


# ------------------------------------------------------------ predicates
def reserves(state: State) -> bool:
    """Drafting room is reserved at the next scheduling: not while a hold lasts or after every adapter was gated
    off, until a step could draft again."""
    return not isinstance(state, Hold) and not (isinstance(state, Plain) and not state.room)


def probe_interval(state: State, tune: Tuning) -> int:
    """Plain steps before a probe cycle (0: never): the base interval times its back-off."""
    return tune.probe_interval * state.probes.cycle_backoff


def probe_due(state: State, tune: Tuning) -> bool:
    interval = probe_interval(state, tune)
    return bool(interval) and state.plain_run >= interval


def plain_probe_due(state: State, prompts: int, tune: Tuning) -> bool:
    """A plain step is due to re-measure plain decoding: probe_interval x its back-off cycles chosen on cost in a
    row. Not in a step with prompts, which would not be timed."""
    interval = tune.probe_interval * state.probes.plain_backoff
    return bool(interval) and not prompts and state.cycle_run >= interval


def remeasure_due(state: State, idle_steps: int, tune: Tuning) -> bool:
    """An adapter that drafted nothing for probe_interval steps drafts once to re-measure its acceptance."""
    interval = probe_interval(state, tune)
    return bool(interval) and idle_steps >= interval


def rides(state: State, acceptance: float, idle_steps: int, tune: Tuning) -> bool:
    """An adapter sequence decodes in the drafting passes with its adapter on instead of drafting: its adapter's
    acceptance is below min_acceptance and it is not due a re-measure."""
    return acceptance < tune.min_acceptance and not remeasure_due(state, idle_steps, tune)


def gated_off(state: State, adapters: tuple[str, ...], est: Estimates, tune: Tuning) -> bool:
    """No adapter of the batch would draft, known without the cost model: every adapter's acceptance is below
    min_acceptance, none is due a re-measure and no probe cycle is due."""
    if not adapters or probe_due(state, tune):
        return False
    return all(rides(state, est.acceptance(a), est.idle_steps(a), tune) for a in set(adapters))


def holds(key: HoldKey, batch: Decoding, tune: Tuning) -> bool:
    """A hold applies to the batch it was priced for and to the batches the same decision prices alike: no adapter
    it was not priced with (one might draft well), within hold_spread of its size, and no more room to draft per
    sequence than it had (a batch priced near its sequences' ends would draft little). At a burst, sequences join
    and finish at nearly every step; re-pricing each time would cost a step without drafting room
    (PLAIN_UNRESERVED) before every new decision."""
    n = len(batch.caps)
    if not set(batch.adapters) <= key.adapters or not key.size / tune.hold_spread <= n <= key.size * tune.hold_spread:
        return False
    return sum(batch.caps) * key.size <= key.room * n * tune.hold_cap_slack


def hold_steps(margin: float, tune: Tuning) -> int:
    """Plain steps that follow a plain decision by `margin` (plain's rate over the best cycle's, less 1) without
    re-pricing: one per hold_per_margin, at most max_hold."""
    return max(0, min(tune.max_hold, int(margin / tune.hold_per_margin)))


# ------------------------------------------------------------ draft lengths
def priced_batch(batch: Decoding, est: Estimates) -> pricing.Batch:
    """The batch as the cost model prices it: each sequence's acceptance, and whether a closed batch is priced by
    its slowest sequence: with a laggard among its adapters (Estimator.batch_acceptance), or with riders beside
    drafters (a rider decodes a token a pass, a drafter of low acceptance about one a cycle: priced by tokens per
    second alone, the riders finish and leave the drafters to end the batch alone)."""
    accs, slowest = est.batch_acceptance(batch.adapters, batch.left)
    if slowest is None and batch.left is not None and any(batch.ride) and not all(batch.ride):
        slowest = batch.left
    riding = len({a for a, r in zip(batch.adapters, batch.ride) if r})
    return pricing.Batch(tuple(accs), batch.caps, batch.ride, batch.num_base, len(set(batch.adapters)), riding,
                         closed=batch.left is not None, slowest=slowest)


def draft_lengths(state: State, priced: pricing.Batch, est: Estimates, tune: Tuning) -> list[int]:
    """Per adapter sequence a draft length in 0..min(k, cap): pricing.best_lengths, or 1 when a probe is due (a
    long run of plain steps re-measures drafting with the cheapest cycle).

    A closed batch (nothing waits to join it) is done when its slowest sequence is. With a laggard among them
    (Estimator.batch_acceptance) the rate is the batch's tokens over the time its slowest sequence takes, and no
    draft is pruned: priced by tokens per second alone, a batch of mixed adapters keeps cycling for its fast ones
    while its slow ones fall behind and then finish alone."""
    if probe_due(state, tune):
        return pricing.lengths_for(priced, 1, tune.min_acceptance)
    return pricing.best_lengths(est, priced, tune.num_draft_tokens, tune.min_acceptance)[0]
