"""The gate's policy as tables: decide(state, batch, estimates, tuning) -> (choice, next state), with fixed pass
costs (`Costs`, milliseconds) in place of the estimator: the overlap pricing (host-bound and device-bound steps),
low acceptance, explore of unmeasured kinds, probes after long runs and their back-off, holds, and bursts whose
batch changes every step."""

from dataclasses import dataclass, field

import pytest

from engine_ext.speculation.policy import (Choice, Decision, Decoding, Explore, Hold, HoldKey, Plain, Probe, Probes,
                                           Speculate, Tuning, decide, holds, hold_steps, measured, reserves)

TUNE = Tuning(num_draft_tokens=4, min_acceptance=0.3, probe_interval=64)


@dataclass(frozen=True)
class Costs:
    """Milliseconds: a drafting pass; a verify pass of t tokens = verify0 + per_token x t; a plain step's device
    time (None: never measured) at the batch sizes in `plain_sizes` (None: every size); host work per plain step and
    per cycle; `cycles`: drafting and verify passes measured. Acceptance per adapter (0.8 unknown), idle steps."""

    base: float = 1.18
    verify0: float = 1.313
    per_token: float = 0.0079
    plain_device: float | None = 1.37
    plain_sizes: tuple[int, ...] | None = None
    plain_host: float = 0.0
    cycle_host: float = 0.0
    cycles: bool = True
    acc: dict = field(default_factory=dict)
    idle: dict = field(default_factory=dict)

    def plain(self, n, distinct, exact=False):
        if self.plain_device is None or (exact and self.plain_sizes is not None and n not in self.plain_sizes):
            return None
        return max(self.plain_device, self.plain_host) / 1e3

    def cycle(self, n, passes, tokens, distinct, riding):
        if not self.cycles:
            return None
        return (passes * self.base + self.verify0 + self.per_token * tokens) / 1e3, self.cycle_host / 1e3

    def verify_slope(self, tokens, distinct):
        return self.per_token / 1e3

    def acceptance(self, name):
        return self.acc.get(name, 0.8)

    def idle_steps(self, name):
        return self.idle.get(name, 0)

    def batch_acceptance(self, adapters, left):
        return [self.acceptance(a) for a in adapters], None


def batch(n=8, adapters=None, caps=4, prompts=0, reserved=True, num_base=0) -> Decoding:
    names = tuple(adapters or ["x"] * n)
    return Decoding(names, (caps,) * len(names), (False,) * len(names), num_base, prompts, None, reserved)


NEAR = {"x": 1.0}
HOST_BOUND = dict(plain_host=1.9, cycle_host=2.3)  # the H200 at 1B, batch 8: host work ~1.9 ms a step
DEVICE_BOUND = dict(plain_host=0.5, cycle_host=0.6)
GATED_OFF = {"x": 0.1}
WIDE = dict(plain_device=0.5, base=2.0)  # plain far ahead of any cycle

ROWS = [
    # id, state, batch, costs -> decision, next state (its type, and fields to check)
    ("explore-nothing-measured", Explore(), batch(), Costs(cycles=False, plain_device=None),
     Decision.SPECULATE_EXPLORE, Explore, {}),
    ("explore-plain-at-this-size", Explore(), batch(), Costs(plain_sizes=(4,)),
     Decision.PLAIN_EXPLORE, Explore, {"plain_run": 1}),
    ("no-explore-with-prompts", Explore(), batch(prompts=1), Costs(plain_sizes=(4,), acc=NEAR, **HOST_BOUND),
     Decision.SPECULATE, Speculate, {}),  # a plain step with prompts is not timed: the sizes measured price it
    ("explore-cycle-with-prompts", Explore(), batch(prompts=1), Costs(plain_device=None),
     Decision.SPECULATE_EXPLORE, Explore, {}),
    # the overlap pricing: the same device costs and acceptance, host-bound -> cycle, device-bound -> plain
    ("host-bound-cycle", Speculate(cycle_run=3), batch(), Costs(acc={"x": 0.9}, **HOST_BOUND),
     Decision.SPECULATE, Speculate, {"cycle_run": 4}),
    ("device-bound-plain", Speculate(cycle_run=3), batch(), Costs(acc={"x": 0.9}, **DEVICE_BOUND),
     Decision.PLAIN_COST, Plain, {"cycle_run": 0, "plain_run": 1}),
    ("device-bound-near", Plain(plain_run=5), batch(), Costs(acc=NEAR, **DEVICE_BOUND),
     Decision.SPECULATE, Speculate, {"plain_run": 0, "cycle_run": 1}),
    ("low-acceptance", Speculate(cycle_run=9), batch(), Costs(acc=GATED_OFF),
     Decision.PLAIN_LOW_ACCEPTANCE, Plain, {"room": False}),
    ("one-adapter-drafts", Plain(), batch(adapters=["x", "y"] * 4), Costs(acc={"x": 0.1, "y": 1.0}, **HOST_BOUND),
     Decision.SPECULATE, Speculate, {}),
    ("remeasure-due", Plain(plain_run=3), batch(), Costs(acc=GATED_OFF, idle={"x": 64}, **DEVICE_BOUND),
     Decision.PLAIN_COST, Hold, {}),  # not gated off: it is priced (one draft) and loses by a wide margin
    ("nothing-to-draft", Speculate(), batch(caps=0), Costs(acc=NEAR),
     Decision.PLAIN_NOTHING_TO_DRAFT, Plain, {"room": True}),
    ("unreserved", Plain(room=False), batch(reserved=False), Costs(acc=NEAR),
     Decision.PLAIN_UNRESERVED, Plain, {"room": True}),
    # probes
    ("probe-after-a-long-plain-run", Plain(plain_run=64, room=False), batch(), Costs(acc=GATED_OFF),
     Decision.SPECULATE_PROBE, Probe, {"kind": "cycle", "plain_run": 0}),
    ("probe-backed-off", Plain(plain_run=64, probes=Probes(cycle_backoff=2)), batch(), Costs(acc=GATED_OFF),
     Decision.PLAIN_LOW_ACCEPTANCE, Plain, {"plain_run": 65}),
    ("probe-judged-lost", Plain(plain_run=2, probes=Probes(2, 1, frozenset({"cycle"}))), batch(), Costs(acc=GATED_OFF),
     Decision.PLAIN_LOW_ACCEPTANCE, Plain, {"probes": Probes(cycle_backoff=4)}),
    ("probe-judged-won", Probe(kind="cycle", probes=Probes(4, 1, frozenset({"cycle"}))), batch(),
     Costs(acc=NEAR, **HOST_BOUND), Decision.SPECULATE, Speculate, {"probes": Probes()}),
    ("plain-probe-after-a-long-cycle-run", Speculate(cycle_run=64), batch(), Costs(acc=NEAR, **HOST_BOUND),
     Decision.PLAIN_PROBE, Probe, {"kind": "plain", "cycle_run": 0}),
    ("no-plain-probe-with-prompts", Speculate(cycle_run=64), batch(prompts=1), Costs(acc=NEAR, **HOST_BOUND),
     Decision.SPECULATE, Speculate, {"cycle_run": 65}),
    ("plain-probe-judged-lost", Probe(kind="plain", plain_run=1, probes=Probes(1, 2, frozenset({"plain"}))), batch(),
     Costs(acc=NEAR, **HOST_BOUND), Decision.SPECULATE, Speculate, {"probes": Probes(plain_backoff=4)}),
    ("plain-probe-judged-won", Probe(kind="plain", plain_run=1, probes=Probes(1, 4, frozenset({"plain"}))), batch(),
     Costs(acc={"x": 0.9}, **DEVICE_BOUND), Decision.PLAIN_COST, Plain, {"probes": Probes()}),
    # holds
    ("wide-margin-holds", Speculate(), batch(), Costs(acc={"x": 0.9}, **WIDE),
     Decision.PLAIN_COST, Hold, {"left": 16, "key": HoldKey(frozenset({"x"}), 8, 32)}),
    ("held", Hold(left=3, key=HoldKey(frozenset({"x"}), 8, 32)), batch(9, reserved=False), Costs(acc=NEAR),
     Decision.PLAIN_HOLD, Hold, {"left": 2, "plain_run": 1}),
    ("last-held-step-reserves", Hold(left=1, key=HoldKey(frozenset({"x"}), 8, 32)), batch(7, reserved=False),
     Costs(acc=NEAR), Decision.PLAIN_HOLD, Plain, {"room": True}),
    ("hold-broken-by-size", Hold(left=3, key=HoldKey(frozenset({"x"}), 8, 32)), batch(11, reserved=False),
     Costs(acc=NEAR), Decision.PLAIN_UNRESERVED, Plain, {"room": True}),
    ("hold-broken-by-adapter", Hold(left=3, key=HoldKey(frozenset({"x"}), 8, 32)),
     batch(adapters=["x"] * 7 + ["y"], reserved=False), Costs(acc=NEAR), Decision.PLAIN_UNRESERVED, Plain, {}),
    ("hold-broken-by-probe", Hold(left=3, key=HoldKey(frozenset({"x"}), 8, 32), plain_run=64), batch(),
     Costs(acc={"x": 0.9}, **WIDE), Decision.SPECULATE_PROBE, Probe, {}),
]


@pytest.mark.parametrize("state,batch_,costs,decision,kind,fields", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_policy_table(state, batch_, costs, decision, kind, fields):
    choice, after = decide(state, batch_, costs, TUNE)
    assert choice.decision is decision, choice
    assert type(after) is kind, after
    for name, value in fields.items():
        assert getattr(after, name) == value, (name, after)
    assert (choice.lengths is not None) == decision.speculates
    assert choice.remeasure == (decision is Decision.PLAIN_PROBE)


def test_explore_and_probes_draft_one_token():
    """Nothing measured: the cheapest cycle measures both pass kinds; a probe cycle re-measures with one draft."""
    assert decide(Explore(), batch(4), Costs(cycles=False), TUNE)[0].lengths == (1,) * 4
    assert decide(Plain(plain_run=64), batch(4), Costs(acc=GATED_OFF), TUNE)[0].lengths == (1,) * 4


@pytest.mark.parametrize("host,passes", [(0.0, 1), (2.3, 1), (6.0, 4)])
def test_host_time_the_device_does_not_hide_favours_longer_cycles(host, passes):
    """At these device costs one drafting pass is the best cycle (each pass costs 1.18 ms for 0.95^j tokens a
    sequence); host work the device does not hide makes passes free up to its time: above a four-pass cycle's
    device time (6.35 ms), four are the best."""
    choice, _ = decide(Speculate(), batch(), Costs(acc={"x": 0.95}, cycle_host=host, plain_host=host), TUNE)
    assert max(choice.lengths) == passes


def test_nothing_to_decide_without_an_adapter_sequence():
    state = Speculate(cycle_run=5)
    assert decide(state, Decoding((), (), (), num_base=4), Costs(), TUNE) == (Choice(None), state)


@pytest.mark.parametrize("sizes", [[8, 9, 7, 10, 6, 8, 9], [6, 8, 6, 8, 6, 8]])
def test_a_hold_rides_out_a_burst_whose_batch_changes_every_step(sizes):
    """At a burst, sequences join and finish at every step: a plain decision by a wide margin holds for batches
    within a third of the one priced, without a step lost to re-pricing (PLAIN_UNRESERVED) at each change."""
    state, costs = Speculate(), Costs(acc={"x": 0.9}, **WIDE)
    choice, state = decide(state, batch(8), costs, TUNE)
    assert choice.decision is Decision.PLAIN_COST and isinstance(state, Hold) and not reserves(state)
    for n in sizes:
        choice, state = decide(state, batch(n, reserved=reserves(state)), costs, TUNE)
        assert choice.decision is Decision.PLAIN_HOLD, (n, choice)
    assert state.left == 16 - len(sizes)


@pytest.mark.parametrize("sizes", [[4, 7, 12, 9, 16, 3, 24], [1, 2, 1, 3, 1, 2]])
def test_cycles_through_a_burst_whose_batch_changes_every_step(sizes):
    """Host-bound at every size, near adapters: a cycle at every step, the run of cycles counted on."""
    state, costs = Speculate(), Costs(acc=NEAR, **HOST_BOUND)
    for i, n in enumerate(sizes):
        choice, state = decide(state, batch(n), costs, TUNE)
        assert choice.decision is Decision.SPECULATE and choice.lengths == (4,) * n, (n, choice)
    assert state.cycle_run == len(sizes)


def test_a_probe_is_judged_once_it_is_measured():
    """A probe cycle's answer before its verify pass is read judges nothing: the decision after the read does."""
    costs = Costs(acc=GATED_OFF)
    choice, state = decide(Plain(plain_run=64), batch(), costs, TUNE)
    assert choice.decision is Decision.SPECULATE_PROBE
    choice, state = decide(state, batch(), costs, TUNE)  # planned while the probe runs
    assert choice.decision is Decision.PLAIN_LOW_ACCEPTANCE and state.probes.cycle_backoff == 1
    choice, state = decide(measured(state, "cycle"), batch(reserved=False), costs, TUNE)
    assert choice.decision is Decision.PLAIN_LOW_ACCEPTANCE and state.probes == Probes(cycle_backoff=2)


@pytest.mark.parametrize("n,adapters,room,held", [
    (8, {"x"}, 32, True), (6, {"x"}, 24, True), (10, {"x"}, 40, True), (11, {"x"}, 44, False), (5, {"x"}, 20, False),
    (8, {"x", "y"}, 32, False), (8, {"x"}, 36, False),  # more drafting room per sequence than priced
])
def test_holds_covers_batches_priced_alike(n, adapters, room, held):
    key = HoldKey(frozenset({"x"}), 8, 32)
    names = sorted(adapters) * n
    b = Decoding(tuple(names[:n]), (room // n,) * (n - room % n) + (room // n + 1,) * (room % n), (False,) * n)
    assert holds(key, b, TUNE) is held


@pytest.mark.parametrize("margin,steps", [(0.8, 16), (0.056, 2), (0.01, 0), (-0.1, 0)])
def test_hold_steps_follow_the_margin(margin, steps):
    assert hold_steps(margin, TUNE) == steps


@pytest.mark.parametrize("state,reserved", [
    (Explore(), True), (Speculate(), True), (Plain(), True), (Plain(room=False), False),
    (Hold(left=2, key=HoldKey(frozenset(), 1, 1)), False), (Probe(kind="cycle"), True),
])
def test_drafting_room_is_reserved_but_while_held_or_gated_off(state, reserved):
    assert reserves(state) is reserved
