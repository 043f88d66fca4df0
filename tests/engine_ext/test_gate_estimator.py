"""The gate's estimator: pass costs as the overlapped loop spends them (max(device, host) per step), from the
StepResults the engine measures, with the launch-to-launch fallback when a step has no device span or host time;
acceptance per adapter."""

import pytest

from engine_ext.speculation import Plan, StepResult
from engine_ext.speculation.estimator import Estimator


def plain_plan(n: int, distinct: int = 1, prompts: int = 0, remeasure: bool = False) -> Plan:
    return Plan(seqs=[None] * (n + prompts), decoding=n, distinct=distinct, remeasure=remeasure)


def cycle_plan(n: int, distinct: int = 1) -> Plan:
    return Plan(seqs=[None] * n, speculate=True, lengths=[1] * n, decoding=n, distinct=distinct)


def twice(est: Estimator, plan: Plan, result: StepResult, seconds: float) -> None:
    """Two samples: the second at a shape replaces the first (which may carry one-off costs)."""
    for _ in range(2):
        est.observe(plan, result, seconds)


@pytest.mark.parametrize("device,host,expected", [
    (1.37e-3, 1.9e-3, 1.9e-3),  # host-bound: the host's work is what the loop waits for
    (1.71e-3, 0.6e-3, 1.71e-3),  # device-bound: the device's
])
def test_a_plain_step_costs_the_larger_of_its_device_and_host_time(device, host, expected):
    est = Estimator()
    twice(est, plain_plan(8), StepResult([("plain", 8, 1, device)], [], host), seconds=5e-3)
    assert est.plain(8, 1) == pytest.approx(expected)
    assert est.plain(8, 1, exact=True) == pytest.approx(expected) and est.plain(32, 1, exact=True) is None


def test_a_plain_step_without_a_device_span_is_priced_launch_to_launch():
    est = Estimator()
    twice(est, plain_plan(8), StepResult(), seconds=2.5e-3)
    assert est.plain(8, 1) == pytest.approx(2.5e-3)


@pytest.mark.parametrize("host,expected", [
    (2.2e-3, (4 * 1.2e-3 + 1.63e-3, 2.2e-3)),  # host time measured: the loop takes the larger
    (0.0, (4 * 1.2e-3 + 1.63e-3 + 0.5e-3, 0.0)),  # none: the step's rest beyond its passes, paid on top of them
])
def test_a_cycle_costs_its_device_passes_and_its_host_time(host, expected):
    est = Estimator()
    passes = [("base", 8, 0, 1.2e-3)] * 4 + [("lora", 40, 8, 1.63e-3)]
    twice(est, cycle_plan(8, 8), StepResult(passes, [], host), seconds=4 * 1.2e-3 + 1.63e-3 + 0.5e-3)
    device, cycle_host = est.cycle(8, 4, 40, 8, 0)
    assert (device, cycle_host) == pytest.approx(expected)


def test_a_cycle_not_measured_yet_pays_at_least_a_plain_steps_host_time():
    est = Estimator()
    twice(est, plain_plan(8), StepResult([("plain", 8, 1, 1.4e-3)], [], 1.9e-3), seconds=1.9e-3)
    assert est.cycle(8, 1, 16, 1, 0) is None  # no drafting or verify pass measured
    est.times.record("base", 8, 0, 1.2e-3)
    device, host = est.cycle(8, 1, 16, 1, 0)  # verify priced from the plain pass until one is measured
    assert device == pytest.approx(1.2e-3 + 1.4e-3) and host == pytest.approx(1.9e-3)


def test_a_cycles_host_time_is_at_most_a_plain_steps_per_forward():
    """A cycle size measured once during a one-off stall (63 ms at one sequence, seen on the H200) is priced at no
    more than its forwards' worth of plain steps' host work, so cycles of that size run, and re-measure it."""
    est = Estimator()
    twice(est, plain_plan(1), StepResult([("plain", 1, 1, 1.75e-3)], [], 0.66e-3), seconds=1.8e-3)
    passes = [("base", 1, 0, 1.15e-3)] * 4 + [("lora", 5, 1, 1.8e-3)]
    est.observe(cycle_plan(1), StepResult(passes, [], 62.9e-3), seconds=70e-3)
    device, host = est.cycle(1, 4, 5, 1, 0)
    assert device == pytest.approx(4 * 1.15e-3 + 1.8e-3) and host == pytest.approx(5 * 0.66e-3)
    est.observe(cycle_plan(1), StepResult(passes, [], 2.1e-3), seconds=6.5e-3)  # the next sample replaces it
    assert est.cycle(1, 4, 5, 1, 0)[1] == pytest.approx(2.1e-3)


def test_prompts_price_nothing_but_acceptance_still_counts():
    est = Estimator()
    est.observe(plain_plan(4, prompts=2), StepResult([("plain", 300, 1, 9e-3)], [], 3e-3), seconds=9e-3)
    passes = [("prompted", 300, 0, 8e-3), ("lora", 10, 1, 1.5e-3)]
    est.observe(cycle_plan(5), StepResult(passes, [("x", 1, 0)], 2e-3), seconds=1e-2)
    assert est.times.get("plain", 4, 1) is None and est.times.get("base", 300, 0) is None
    assert est.times.get("lora", 10, 1) == 1.5e-3
    assert est.acceptance("x") < 0.8  # the prior, pulled down by a rejected draft


def test_an_untimed_step_records_acceptance_only():
    est = Estimator()
    assert not est.observe(cycle_plan(2), StepResult([("base", 2, 0, 1.0)], [("x", 1, 1)], 1.0), 9.0, timed=False)
    assert est.times.get("base", 2, 0) is None and est.acceptance("x") > 0.8


def test_a_remeasure_replaces_the_plain_time():
    est = Estimator()
    twice(est, plain_plan(4), StepResult([("plain", 4, 1, 0.3)], []), seconds=0.3)
    est.observe(plain_plan(4, remeasure=True), StepResult([("plain", 4, 1, 0.012)], []), seconds=0.012)
    assert est.plain(4, 1) == 0.012


def test_queries_change_nothing():
    """The policy reads the estimator as data: asking about an adapter never seen adds no record."""
    est = Estimator(initial_acceptance=0.7)
    assert est.acceptance("new") == 0.7 and est.idle_steps("new") == 0
    assert est.batch_acceptance(("new", "new"), (5, 5)) == ([0.7, 0.7], None)
    assert not est.adapters


def test_idle_adapters_count_towards_their_remeasure():
    est = Estimator()
    est.note_idle(["a", "b", "a"], [2, 0, 1])  # a drafts in this cycle, b does not
    est.note_idle(["a", "b"], None)  # a plain step
    assert (est.idle_steps("a"), est.idle_steps("b")) == (1, 2)
    est.observe(cycle_plan(1), StepResult([], [("b", 1, 1)]), 0.0)
    assert est.idle_steps("b") == 0


def test_a_laggard_in_a_closed_batch_prices_it_by_its_slowest():
    est = Estimator()
    for name, accepted in (("fast", 4), ("slow", 0)):
        for _ in range(30):  # the slow one judges a draft a verify: 30 give it the evidence to price the batch
            est.adapter(name).observe(4, accepted, 0.1)
    accs, slowest = est.batch_acceptance(("fast", "slow"), (30, 30))
    assert slowest == (30, 30) and accs[0] > accs[1]
    assert est.batch_acceptance(("fast", "slow"), None)[1] is None  # an open batch: by tokens per second


def test_a_cycle_that_ran_prompts_prices_its_pure_passes_but_not_its_host_time():
    """Prompts joining a cycle add host work (their entries, first tokens) that a decoding cycle does not pay: it
    prices no cycle, as a plain step with prompts prices no plain step."""
    est = Estimator()
    passes = [("prompted", 300, 0, 8e-3)] + [("base", 8, 0, 1.2e-3)] * 3 + [("lora", 40, 8, 1.63e-3)]
    twice(est, cycle_plan(8, 8), StepResult(passes, [], 9e-3), seconds=2e-2)
    assert est.times.get("base", 8, 0) == pytest.approx(1.2e-3) and est.times.get("lora", 40, 8) == 1.63e-3
    assert est.times.get("cycle_host", 8, 0) is None and est.times.get("overhead", 8, 0) is None


def test_estimates_answered_from_the_cache_follow_every_new_measurement():
    """StepTimes.get and Estimator.cycle are cached between measurements (the gate prices every step on the host):
    each new sample, of any kind, is in the next answer."""
    est = Estimator()
    cycle = StepResult([("base", 8, 1, 1.0e-3), ("lora", 16, 1, 2.0e-3)], [], 1.0e-3)
    twice(est, cycle_plan(8), cycle, seconds=4e-3)
    before = est.cycle(8, 1, 16, 1, 1)
    assert before == pytest.approx((3.0e-3, 1.0e-3)) and est.cycle(8, 1, 16, 1, 1) == before
    est.observe(cycle_plan(8), StepResult([("base", 8, 1, 2.0e-3), ("lora", 16, 1, 2.0e-3)], [], 1.0e-3), 5e-3)
    assert est.cycle(8, 1, 16, 1, 1)[0] == pytest.approx(3.0e-3 + 0.2 * 1.0e-3)  # the EMA moved the drafting pass
    # a plain step's host time bounds a cycle's (at most passes + 1 plain steps' host work): a plain sample changes it
    twice(est, plain_plan(8), StepResult([("plain", 8, 1, 1.0e-3)], [], 0.2e-3), seconds=2e-3)
    assert est.cycle(8, 1, 16, 1, 1)[1] == pytest.approx(0.4e-3)
    assert est.times.get("plain", 8, 1) == pytest.approx(1.0e-3)
    twice(est, plain_plan(8), StepResult([("plain", 8, 1, 1.5e-3)], [], 0.2e-3), seconds=2e-3)
    assert est.times.get("plain", 8, 1) == pytest.approx(0.8 * (0.8 * 1.0e-3 + 0.2 * 1.5e-3) + 0.2 * 1.5e-3)


def test_a_run_of_cycles_pays_the_loops_gap_beyond_its_device_and_host_time():
    """A cycle read right after a cycle adds its period beyond max(device, host) to the price of cycles of its size
    (device time lost outside its passes' spans: 0.7 ms here); a cycle after a plain step (a switch of kinds) or
    without a period adds nothing, and a period short of max(device, host) (a host-bound cycle, noise) lowers the
    estimate without taking it below zero."""
    passes = [("base", 8, 0, 1.2e-3)] * 4 + [("lora", 40, 8, 1.63e-3)]
    device = 4 * 1.2e-3 + 1.63e-3
    est = Estimator()
    twice(est, plain_plan(8), StepResult([("plain", 8, 1, 1.4e-3)], [], 1.0e-3, 1.4e-3), seconds=1.4e-3)
    est.observe(cycle_plan(8, 8), StepResult(passes, [], 2.2e-3, device + 0.7e-3), seconds=1e-2)  # after a plain
    est.observe(cycle_plan(8, 8), StepResult(passes, [], 2.2e-3), seconds=1e-2)  # no period
    assert est.cycle(8, 4, 40, 8, 0) == pytest.approx((device, 2.2e-3))
    twice(est, cycle_plan(8, 8), StepResult(passes, [], 2.2e-3, device + 0.7e-3), seconds=1e-2)
    assert est.cycle(8, 4, 40, 8, 0) == pytest.approx((device + 0.7e-3, 2.2e-3 + 0.7e-3))
    est.observe(cycle_plan(8, 8), StepResult(passes, [], 2.2e-3, device - 0.3e-3), seconds=1e-2)
    assert est.cycle(8, 4, 40, 8, 0)[0] == pytest.approx(device + 0.8 * 0.7e-3 - 0.2 * 0.3e-3)
    for _ in range(20):
        est.observe(cycle_plan(8, 8), StepResult(passes, [], 2.2e-3, device - 0.3e-3), seconds=1e-2)
    assert est.cycle(8, 4, 40, 8, 0)[0] == pytest.approx(device)


def test_a_run_of_plain_steps_pays_the_loops_gap():
    est = Estimator()
    twice(est, plain_plan(8), StepResult([("plain", 8, 1, 1.4e-3)], [], 1.0e-3, 1.9e-3), seconds=1.9e-3)
    assert est.plain(8, 1) == pytest.approx(1.9e-3)  # the device's 1.4 ms and 0.5 ms of it idle
    est.observe(cycle_plan(8), StepResult([("base", 8, 0, 1.2e-3), ("lora", 16, 1, 1.5e-3)], [], 1e-3, 2.7e-3), 3e-3)
    est.observe(plain_plan(8), StepResult([("plain", 8, 1, 1.4e-3)], [], 1.0e-3, 9e-3), seconds=9e-3)  # after a cycle
    assert est.plain(8, 1) == pytest.approx(1.9e-3)
