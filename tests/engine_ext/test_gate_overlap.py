"""The gate in the overlapped loop at light and moderate load (overlap_sim.py: open-loop arrivals, device passes and
host work from the H200's tables at 1B rank 16, StepResults as the engine measures them): with drafts that are
accepted (near adapters) nearly every decode step is a cycle, with drafts that are rejected nearly every one is plain,
and in between the gate's TPOT is that of the better of plain steps and forced drafting."""

import dataclasses

import pytest

from engine_ext import SpecConfig
from engine_ext.speculation import Gate, NoSpeculation
from overlap_sim import H200_1B_R16, H200_1B_R16_FAST_HOST, Traffic, simulate

NEAR = {f"near{i}": 1.0 for i in range(4)} | {None: 0.0}  # four near adapters and 20% base-only requests


def traffic(acceptance: float | dict, rate: float = 30.0) -> Traffic:
    adapters = acceptance if isinstance(acceptance, dict) else {"a": acceptance, "b": acceptance}
    return Traffic(count=150, rate=rate, adapters=adapters)


def gated(costs, acceptance, rate: float = 30.0, legacy: bool = False):
    return simulate(Gate(SpecConfig(num_draft_tokens=4)), costs, traffic(acceptance, rate), legacy=legacy)


@pytest.mark.parametrize("acceptance", [1.0, 0.98, NEAR], ids=["all", "0.98", "near-and-base"])
def test_accepted_drafts_at_light_load_run_cycles(acceptance):
    """The H200's host work (~1.9 ms a step) exceeds a plain step's device time at light load: a plain step costs
    its host time, a cycle of four drafts its device time, and the gate runs cycles (at least 90% of decode
    steps), at forced drafting's TPOT."""
    run = gated(H200_1B_R16, acceptance)
    forced = simulate(Gate(SpecConfig(num_draft_tokens=4, gate=False)), H200_1B_R16, traffic(acceptance))
    plain = simulate(NoSpeculation(), H200_1B_R16, traffic(acceptance))
    assert run.cycle_share >= 0.9, (run.cycle_share, dict(run.decisions))
    assert run.tpot() <= 1.02 * forced.tpot() and run.tpot() < 0.8 * plain.tpot()


def test_accepted_drafts_run_cycles_when_the_device_bounds_the_loop():
    run = gated(H200_1B_R16_FAST_HOST, 1.0)
    assert run.cycle_share >= 0.9, (run.cycle_share, dict(run.decisions))


@pytest.mark.parametrize("idle", [0.3, 1.0, 2.0])
def test_a_cycle_that_loses_device_time_outside_its_passes_is_priced_with_it(idle):
    """Device time a cycle spends outside its passes' spans (sampling and verification between them, waiting for
    the next cycle's launch) shows in its period, from the end of the cycle before it to its own end: priced with
    it, the gate's TPOT is the better of plain steps' and forced drafting's whatever a cycle loses (at 0.3 ms
    cycles still win, from 1 ms on plain does). Priced from their spans alone (no periods measured), the gate
    keeps running cycles that lose 2 ms each and decodes slower than plain."""
    costs = dataclasses.replace(H200_1B_R16_FAST_HOST, cycle_idle=idle)
    plain = simulate(NoSpeculation(), costs, traffic(1.0))
    forced = simulate(Gate(SpecConfig(num_draft_tokens=4, gate=False)), costs, traffic(1.0))
    run = gated(costs, 1.0)
    assert run.tpot() <= 1.03 * min(plain.tpot(), forced.tpot()), (run.tpot(), plain.tpot(), forced.tpot())
    if idle >= 1.0:
        assert run.cycle_share <= 0.2, (run.cycle_share, dict(run.decisions))
    if idle == 2.0:
        spans_only = simulate(Gate(SpecConfig(num_draft_tokens=4)), costs, traffic(1.0), periods=False)
        assert spans_only.cycle_share >= 0.8 and spans_only.tpot() > 1.1 * plain.tpot()


@pytest.mark.parametrize("acceptance", [0.0, 0.3])
def test_rejected_drafts_run_plain(acceptance):
    run = gated(H200_1B_R16, acceptance)
    plain = simulate(NoSpeculation(), H200_1B_R16, traffic(acceptance))
    assert run.cycle_share <= 0.05, (run.cycle_share, dict(run.decisions))
    assert run.tpot() <= 1.02 * plain.tpot()


@pytest.mark.parametrize("costs", [H200_1B_R16, H200_1B_R16_FAST_HOST], ids=["host-bound", "device-bound"])
@pytest.mark.parametrize("rate", [30.0, 90.0])
@pytest.mark.parametrize("acceptance", [1.0, 0.9, 0.6])
def test_gate_tpot_near_the_better_mode(costs, rate, acceptance):
    run = gated(costs, acceptance, rate)
    plain = simulate(NoSpeculation(), costs, traffic(acceptance, rate))
    forced = simulate(Gate(SpecConfig(num_draft_tokens=4, gate=False)), costs, traffic(acceptance, rate))
    assert run.tpot() <= 1.03 * min(plain.tpot(), forced.tpot()), (run.tpot(), plain.tpot(), forced.tpot())


@pytest.mark.parametrize("acceptance,cycles", [(1.0, True), (0.0, False)])
def test_steps_measured_without_device_spans_or_host_time(acceptance, cycles):
    """A StepResult without a "plain" pass or host_s (the engine before it measured them): plain steps are priced
    launch to launch, a cycle's rest beyond its passes as its overhead, and the decisions still follow the drafts."""
    run = gated(H200_1B_R16, acceptance, legacy=True)
    assert run.cycle_share >= 0.9 if cycles else run.cycle_share <= 0.05, (run.cycle_share, dict(run.decisions))
