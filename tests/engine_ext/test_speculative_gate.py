"""The gate: draft lengths from acceptance, a cost model from measured pass times, and decisions
counted in stats(); drafting off when adapters are far from the base, on when they are close."""

import time
from dataclasses import replace

import pytest

from engine_ext import EngineConfig, LLMEngine, SamplingParams, SpecConfig, StepContext
from engine_ext.speculation import Decision, Gate, StepResult, policy
from engine_ext.speculation.acceptance import AdapterAcceptance, expected_tokens
from engine_ext.speculation.cost import StepTimes
from engine_ext.scheduler import ScheduledBatch
from engine_ext.sequence import Sequence
from engine_ext.stats import AdapterStats
from tiny_models import build_adapter, build_model


@pytest.mark.parametrize("a,m,expected", [(0.0, 3, 1.0), (1.0, 3, 4.0), (0.5, 1, 1.5), (0.5, 2, 1.75)])
def test_expected_tokens(a, m, expected):
    assert expected_tokens(a, m) == pytest.approx(expected)


def test_acceptance_counts_only_judged_drafts():
    acc, stats = AdapterAcceptance(ema=0.5), AdapterStats()
    for drafted, accepted in ((4, 1), (4, 4)):  # first: d1 accepted, d2 rejected, d3/d4 never judged
        acc.observe(drafted=drafted, accepted=accepted, weight=1.0)
        stats.observe_verify(drafted, accepted)
        if accepted == 1:
            assert stats.acceptance_rate == 0.5 and acc.ema == 0.5
    assert stats.acceptance_rate == 5 / 6 and acc.ema == 1.0
    assert stats.speculative()["draft_efficiency"] == 5 / 8 and stats.speculative()["mean_accepted_length"] == 2.5


def test_acceptance_estimate_weighs_every_judged_draft():
    """One early rejection among many accepted drafts barely moves the estimate: a is accepted over judged
    drafts (decayed counts), not an average of per-verify ratios, where a lone 0/1 weighed as much as a 4/4."""
    acc = AdapterAcceptance(ema=0.8)
    for _ in range(15):
        acc.observe(drafted=4, accepted=4, weight=0.1)
    acc.observe(drafted=4, accepted=0, weight=0.1)  # d1 rejected: one judged draft
    assert 0.95 < acc.ema < 1.0  # an average of per-verify ratios: 0.9
    for _ in range(30):  # the adapter drifts away from the base: the estimate follows
        acc.observe(drafted=4, accepted=0, weight=0.1)
    assert acc.ema < 0.3
    fresh = AdapterAcceptance(ema=0.8)  # the prior counts as one judged draft
    fresh.observe(drafted=1, accepted=1, weight=0.1)
    assert fresh.ema == pytest.approx((0.9 * 0.8 + 1) / (0.9 + 1))


def measure(gate_or_times, kind, tokens, adapters, seconds):
    """Two samples: the second at a shape replaces the first (which may carry one-off costs)."""
    times = getattr(gate_or_times, "times", gate_or_times)
    for _ in range(2):
        times.record(kind, tokens, adapters, seconds)


def pin_times(engine, base, lora, plain, still_measured=()):
    """The engine's cost model fixed at these seconds per pass (base: 4 tokens; lora: a 4-sequence verify of 4
    drafts each; plain: a 4-sequence plain step; no overhead) whatever this machine measures, but for the pass kinds
    `still_measured`: how the tiny model's passes compare on a CPU depends on the machine, and a test of what the
    engine does with a decision must not. Returns the engine's StepTimes."""
    times = StepTimes()
    measure(times, "base", 4, 0, base)
    measure(times, "lora", 20, 1, lora)
    measure(times, "plain", 4, 1, plain)
    record = times.record
    times.record = lambda kind, *measured, **how: record(kind, *measured, **how) if kind in still_measured else None
    engine.gate.estimator.times = times
    return times


def decide(gate, adapters, num_base=0, prompts=0, caps=None) -> policy.Choice:
    """One decision of the gate's policy for this decoding batch (draft lengths of its own choosing), counted."""
    caps = tuple(caps or [gate.cfg.num_draft_tokens] * len(adapters))
    batch = policy.Decoding(tuple(adapters), caps, (False,) * len(adapters), num_base, prompts)
    choice, gate.state = policy.decide(gate.state, batch, gate.estimator, gate.tuning)
    gate.count(choice.decision)
    return choice


def test_draft_length_follows_acceptance_and_cost():
    gate = Gate(SpecConfig(num_draft_tokens=4, gate=True))
    measure(gate, "base", 8, 0, 0.010)
    measure(gate, "lora", 8, 2, 0.020)
    gate.adapter("close").ema, gate.adapter("far").ema, gate.adapter("mid").ema = 0.98, 0.1, 0.6
    lengths = gate.draft_lengths(["close", "far", "mid"], [4, 4, 4], batch=8)
    # Every adapter drafts the cycle's passes, one below min_acceptance a single token, while the verify pass's
    # cost per token is unknown (one size measured).
    assert lengths == [4, 1, 4]
    assert gate.draft_lengths(["close"], [2], batch=8) == [2]  # never past the sequence's end
    # The cost per verify token measured (0.5 ms, a twentieth of a base pass): each adapter keeps the drafts
    # whose expected tokens repay their verify tokens at the cycle's rate (a^j >= rate x 0.5 ms), and at least
    # one (next to free, and it keeps the adapter's estimate current).
    measure(gate, "lora", 16, 2, 0.024)
    lengths = gate.draft_lengths(["close", "far", "mid"], [4, 4, 4], batch=8)
    rate = gate.predicted_rate(["close", "far", "mid"], lengths, 5)
    assert lengths[0] == 4 and lengths[1] == 1 and 1 < lengths[2] < 4
    assert 0.6 ** lengths[2] >= rate * 0.0005 > 0.6 ** (lengths[2] + 1)


def test_draft_passes_maximise_the_predicted_rate():
    # Base passes nearly as dear as an adapter-on pass: one drafting pass is the best cycle.
    dear = Gate(SpecConfig(num_draft_tokens=4, gate=True))
    measure(dear, "base", 8, 0, 0.019)
    measure(dear, "lora", 8, 2, 0.020)
    dear.adapter("a").ema = dear.adapter("b").ema = 0.5
    assert dear.draft_lengths(["a", "b"], [4, 4], batch=8) == [1, 1]
    # Cheap base passes, but a verify pass that turns dear past 8 tokens: three passes (8 verify tokens) win.
    gate = Gate(SpecConfig(num_draft_tokens=4, gate=True))
    measure(gate, "base", 2, 0, 0.002)
    for tokens, seconds in ((2, 0.010), (4, 0.011), (8, 0.012), (16, 0.060)):
        measure(gate, "lora", tokens, 2, seconds)
    gate.adapter("a").ema = gate.adapter("b").ema = 0.9
    assert gate.draft_lengths(["a", "b"], [4, 4], batch=2) == [3, 3]
    rates = {m: gate.predicted_rate(["a", "b"], [m, m], 0) for m in range(1, 5)}
    assert max(rates, key=rates.get) == 3


def test_decide_compares_measured_rates():
    gate = Gate(SpecConfig(num_draft_tokens=2, gate=True))
    gate.adapter("x").ema = 0.9
    measure(gate, "base", 2, 0, 0.010)
    measure(gate, "plain", 2, 1, 0.040)  # adapters are expensive: speculation pays
    measure(gate, "lora", 6, 1, 0.045)
    assert decide(gate, ["x", "x"]).lengths
    slow = Gate(SpecConfig(num_draft_tokens=2, gate=True))
    slow.adapter("x").ema = 0.9
    measure(slow, "base", 2, 0, 0.040)
    measure(slow, "plain", 2, 1, 0.041)  # adapters nearly free and drafting slow: plain wins
    measure(slow, "lora", 6, 1, 0.120)
    assert not decide(slow, ["x", "x"]).lengths
    assert gate.decisions["speculate"] == 1 and slow.decisions["plain_cost"] == 1


def test_plain_step_measured_before_plain_is_priced():
    """Only a verify-sized adapter-on pass is measured: plain decoding is not priced at that (larger) pass's
    cost, which would keep the gate speculating without ever measuring plain; one plain step measures it."""
    gate = Gate(SpecConfig(num_draft_tokens=2, gate=True))
    gate.adapter("x").ema = 0.9
    measure(gate, "base", 2, 0, 0.010)
    measure(gate, "lora", 6, 1, 0.045)
    assert not decide(gate, ["x", "x"]).lengths
    assert gate.decisions["plain_explore"] == 1
    measure(gate, "plain", 2, 1, 0.012)  # plain is cheap here: 2 tokens / 12 ms beat 5.4 tokens / 65 ms
    assert not decide(gate, ["x", "x"]).lengths
    assert gate.decisions["plain_cost"] == 1


def test_step_times_fall_back_to_nearest_bucket():
    t = StepTimes()
    t.record("lora", 4, 1, 5.0)  # the first pass at a shape (may carry one-off costs)...
    assert t.get("lora", 4, 1) == 5.0
    t.record("lora", 4, 1, 0.01)  # ...is replaced by the second, not averaged with it
    assert t.get("lora", 4, 1) == 0.01 and t.get("lora", 16, 1) == 0.01 and t.get("lora", 2, 8) == 0.01
    t.record("lora", 4, 1, 0.02)  # later samples are averaged in
    assert t.get("lora", 4, 1) == pytest.approx(0.8 * 0.01 + 0.2 * 0.02)
    measure(t, "lora", 16, 1, 0.03)
    assert t.get("lora", 16, 1) == 0.03 and t.get("lora", 32, 1) == 0.03
    assert t.get("base", 4, 0) is None and t.get("lora", 32, 1, exact=True) is None


def test_step_times_interpolate_between_measured_buckets():
    t = StepTimes()
    measure(t, "lora", 64, 32, 0.0023)
    measure(t, "lora", 160, 32, 0.0034)  # bucket 256, measured at 160 tokens
    # 128 tokens (bucket 128, not measured) lie two thirds of the way from 64 to 160 tokens
    assert t.get("lora", 128, 32) == pytest.approx(0.0023 + 0.0011 * 64 / 96)
    assert t.get("lora", 128, 32, exact=True) is None
    assert t.get("lora", 512, 32) == 0.0034  # beyond the measured sizes: the nearest, unscaled
    assert t.get("lora", 128, 8) in (0.0023, 0.0034)  # another adapter bucket: no line to draw, the nearest


def test_unmeasured_middle_cycle_is_priced_between_its_neighbours():
    """After a cold gate's first cycles (one drafting pass, then four), a three-pass cycle's verify pass lies
    between the two measured ones. Priced at the nearer-by-bucket 64-token pass, it looked cheap enough to be
    run (and so measured) once per window, at 0.985 acceptance where four passes are clearly better."""
    names = [f"a{i}" for i in range(32)]
    gate = Gate(SpecConfig(num_draft_tokens=4, gate=True))
    measure(gate, "base", 32, 0, 0.0013)
    measure(gate, "lora", 64, 32, 0.0023)
    measure(gate, "lora", 160, 32, 0.0034)
    measure(gate, "overhead", 32, 0, 0.002)
    for n in names:
        gate.adapter(n).ema = 0.985
    assert gate.draft_lengths(names, [4] * 32, batch=32) == [4] * 32


def test_plain_measured_once_at_each_batch_size_as_the_batch_shrinks():
    """As sequences finish the batch falls into smaller buckets: one plain step measures each (a larger batch's
    step made plain look dearer than it is there), never a verify pass; a measured bucket is not explored again."""
    gate = Gate(SpecConfig(num_draft_tokens=2, gate=True))
    gate.adapter("x").ema = 0.9
    measure(gate, "base", 32, 0, 0.010)
    measure(gate, "base", 8, 0, 0.009)
    measure(gate, "lora", 96, 1, 0.030)
    measure(gate, "plain", 32, 1, 0.020)
    assert gate.times.get("plain", 8, 1, exact=True) is None
    assert not decide(gate, ["x"] * 8).lengths and gate.decisions["plain_explore"] == 1
    measure(gate, "plain", 8, 1, 0.012)
    decide(gate, ["x"] * 8).lengths
    decide(gate, ["x"] * 32).lengths
    assert gate.decisions["plain_explore"] == 1 and sum(gate.decisions.values()) == 3


def test_no_plain_exploring_in_a_step_with_prompts():
    """A plain step with prompts in it is not timed, so exploring plain there would measure nothing and, under
    steady arrivals (a prompt in most steps), repeat step after step: the measured sizes around it price plain
    instead, and with no plain step measured at all the cycle runs."""
    gate = Gate(SpecConfig(num_draft_tokens=2, gate=True))
    gate.adapter("x").ema = 0.9
    measure(gate, "base", 8, 0, 0.009)
    measure(gate, "lora", 24, 1, 0.015)
    assert decide(gate, ["x"] * 8, prompts=2).lengths
    assert gate.decisions["speculate_explore"] == 1 and "plain_explore" not in gate.decisions
    measure(gate, "plain", 4, 1, 0.008)
    measure(gate, "plain", 16, 1, 0.016)  # plain at 8 sequences lies between: 0.012 s, 667 tok/s
    assert gate.times.get("plain", 8, 1, exact=True) is None
    assert not decide(gate, ["x"] * 8, prompts=1).lengths  # plain priced at 667 tok/s, above the cycle's
    assert gate.decisions["plain_cost"] == 1 and "plain_explore" not in gate.decisions
    gate.state = policy.Plain()  # (priced plain by a margin, the gate holds: here the next step is priced)
    assert not decide(gate, ["x"] * 8).lengths  # no prompts: one plain step measures this size
    assert gate.decisions["plain_explore"] == 1


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("gate")
    m = build_model("llama", str(root / "m"))
    all7 = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    return m, {"close": build_adapter(m, str(root / "close"), seed=1, r=16, std=0.01, target_modules=all7),
               "far": build_adapter(m, str(root / "far"), seed=2, r=64, alpha=128, std=0.3, target_modules=all7)}


@pytest.mark.parametrize("adapter,drafts_expected", [("far", False), ("close", True)])
def test_gate_turns_drafting_off_for_far_and_on_for_close_adapters(model, adapter, drafts_expected):
    path, adapters = model
    engine = LLMEngine(EngineConfig(model=path, num_kv_blocks=256, speculative=SpecConfig(num_draft_tokens=4)))
    pin_times(engine, base=0.010, lora=0.045, plain=0.040)  # adapters dear: drafting pays where drafts are accepted
    engine.add_adapter(adapter, adapters[adapter])
    prompts = [[i + 1, i + 2, i + 3] for i in range(4)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    engine.generate(prompt_token_ids=prompts, sampling_params=params, adapter_names=[adapter] * 4)  # learn
    before = engine.stats()["speculative"]
    engine.generate(prompt_token_ids=prompts, sampling_params=params, adapter_names=[adapter] * 4)
    after = engine.stats()
    passes = after["speculative"]["draft_passes"] - before["draft_passes"]
    decisions = after["speculative"]["gate_decisions"]
    acceptance = after["adapters"][adapter]["acceptance_rate"]
    if drafts_expected:
        assert acceptance > 0.9 and passes > 0 and decisions.get("speculate", 0) > 0
    else:
        assert acceptance < 0.3 and passes == 0 and decisions.get("plain_low_acceptance", 0) > 0
        # gated off: the fast path, which stops reserving drafting room (no lookahead blocks) ...
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", prompt_token_ids=p, sampling_params=params, adapter_name=adapter)
        for _ in range(4):
            engine.step()
        running = list(engine.scheduler.running.values())
        assert running and engine.gate.lookahead == 0
        assert all(len(s.block_table) == -(-s.num_tokens // engine.config.block_size) for s in running)
        while engine.has_unfinished_requests:
            engine.step()
        # ... and still produces plain decoding's tokens
        plain = LLMEngine(EngineConfig(model=path, num_kv_blocks=256))
        plain.add_adapter(adapter, adapters[adapter])
        ref = plain.generate(prompt_token_ids=prompts, sampling_params=params, adapter_names=[adapter] * 4)
        out = engine.generate(prompt_token_ids=prompts, sampling_params=params, adapter_names=[adapter] * 4)
        assert [o.token_ids for o in out] == [o.token_ids for o in ref]


def test_gated_off_needs_every_adapter_low_and_no_remeasure_due():
    gate = Gate(SpecConfig(num_draft_tokens=4, gate=True))
    est, tune = gate.estimator, gate.tuning

    def gated_off(adapters, state=policy.Explore()):
        return policy.gated_off(state, tuple(adapters), est, tune)

    for name in ("a", "b"):
        gate.adapter(name).ema = 0.0
    assert gated_off(["a", "b", "a"])
    assert not gated_off([])  # nothing to gate
    gate.adapter("c").ema = 0.9
    assert not gated_off(["a", "c"])  # c drafts
    gate.adapter("b").idle_steps = gate.probe_interval
    assert not gated_off(["a", "b"])  # b is due a re-measure
    gate.adapter("b").idle_steps = 0
    assert not gated_off(["a", "b"], policy.Plain(plain_run=gate.probe_interval))  # a probe cycle is due


def test_per_cycle_overhead_favours_longer_cycles():
    """Pass times as measured on the H200 (1B shape, batch 32, 32 rank-16 adapters, acceptance 0.99): by device
    time alone 3 drafting passes look best; host work paid once per cycle (0.9 ms) makes 4 the better cycle,
    as the engine measured (k=4 4% faster than k=3)."""
    names = [f"a{i}" for i in range(32)]
    picks = {}
    for overhead in (None, 0.0009):
        gate = Gate(SpecConfig(num_draft_tokens=4, gate=True))
        measure(gate, "base", 32, 0, 0.001374)
        for tokens, t in ((64, 0.002215), (128, 0.002590), (160, 0.002906)):
            measure(gate, "lora", tokens, 32, t)
        if overhead is not None:
            measure(gate, "overhead", 32, 0, overhead)
        for n in names:
            gate.adapter(n).ema = 0.99
        picks[overhead] = gate.draft_lengths(names, [4] * 32, batch=32)[0]
    assert picks == {None: 3, 0.0009: 4}


def test_cycles_feed_the_per_pass_cost_model(model):
    """A cycle is timed as a whole (its passes are queued without a host sync): each pass by its device span, and
    its host work once (StepResult.host_s; measured without it, the rest of the cycle's step, launch to the next
    launch, as the cycle's overhead)."""
    path, adapters = model
    engine = LLMEngine(EngineConfig(model=path, num_kv_blocks=256, speculative=SpecConfig(num_draft_tokens=3,
                                                                                            gate=False)))
    engine.add_adapter("close", adapters["close"])
    prompts = [[i + 1, i + 2, i + 3] for i in range(4)]
    engine.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=12, ignore_eos=True),
                    adapter_names=["close"] * 4)
    assert engine.stats()["speculative"]["cycles"] > 0
    times = engine.gate.times
    assert times.get("base", 4, 0, exact=True) > 0  # 4 sequences drafting
    assert times.get("lora", 16, 1, exact=True) > 0  # verify: 4 x (last + 3 drafts)
    host = [times.get(kind, 4, 0, exact=True) for kind in ("cycle_host", "overhead")]  # once per cycle, by batch
    assert any(t is not None and t >= 0 for t in host)


@pytest.mark.parametrize("late_sampled", [False, True], ids=["greedy-arrival", "sampled-arrival"])
def test_passes_that_ran_prompts_price_no_draft_length(model, late_sampled):
    """A request arriving during a cycle has its prompt run in the next drafting pass (a sampled arrival too: its
    draws are on the device). That pass's time is the prompt's as much as the drafts', so the gate does not price
    draft lengths by it (a plain step with prompts in it prices no plain decoding either). The cycle's other
    passes, and the next cycle's, are recorded once the steps are read (a step later)."""
    path, adapters = model
    engine = LLMEngine(EngineConfig(model=path, num_kv_blocks=256, speculative=SpecConfig(num_draft_tokens=3,
                                                                                            gate=False)))
    engine.add_adapter("close", adapters["close"])
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    late = SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=1) if late_sampled else params
    for i in range(4):
        engine.add_request(f"r{i}", prompt_token_ids=[i + 1, i + 2, i + 3], sampling_params=params, adapter_name="close")
    engine.step()  # their prompts: a plain step
    arrival = StepContext(arrivals=lambda: "late" not in engine.seqs and engine.add_request(
        "late", prompt_token_ids=list(range(1, 41)), sampling_params=late, adapter_name="close"))
    engine.step(arrival)  # a cycle: the 40-token prompt arrives after its first drafting pass
    engine.step()  # the next cycle; reads this one
    spec = engine.stats()["speculative"]
    assert spec["joined"] == 1 and spec["ridden_prompts"] == 1
    times = engine.gate.times
    assert times.get("base", 4, 0, exact=True) > 0  # the first drafting pass
    # the prompt ran in pass 2 (not recorded); in pass 3 it drafted, adapters off; the verify pass ran
    # 4 x (last + 3 drafts) and the late one's [first token, 1 draft]
    # (keys are power-of-two buckets: the prompted pass of 44 tokens would be ("base", 64, 1))
    assert {key for key in times._t if key[0] == "base"} == {("base", 4, 0), ("base", 8, 0)}
    assert times.get("lora", 18, 1, exact=True) > 0
    engine.step()
    assert times.get("lora", 20, 1, exact=True) > 0


@pytest.mark.parametrize("gate_on", [True, False], ids=["gated", "forced"])
def test_plain_steps_and_cycle_overhead_are_priced_by_the_whole_engine_step(model, gate_on, monkeypatch):
    """Output processing is paid per plain step but once per cycle: here made 30 ms slower, it is host work the
    device does not hide, so a plain step is priced at no less than that, and so is a cycle (by its host time, or,
    measured without it, by its steps' whole time). (With the gate off every decoding step of this traffic is a
    cycle: no plain step to time.)"""
    path, adapters = model
    engine = LLMEngine(EngineConfig(model=path, num_kv_blocks=256, speculative=SpecConfig(num_draft_tokens=2,
                                                                                            gate=gate_on)))
    engine.add_adapter("close", adapters["close"])
    emit = engine._emit

    def slow_emit(touched):
        time.sleep(0.03)
        return emit(touched)

    monkeypatch.setattr(engine, "_emit", slow_emit)
    prompts = [[i + 1, i + 2, i + 3] for i in range(4)]
    engine.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=8, ignore_eos=True),
                    adapter_names=["close"] * 4)
    est, times = engine.gate.estimator, engine.gate.times
    plain = [est.plain(tokens, adapters) for (kind, tokens, adapters) in times._t if kind == "plain"]
    assert (plain and min(plain) >= 0.03) if gate_on else not plain
    # plain decoding's price comes from decode steps only: the prefill step (12 prompt tokens) is not recorded,
    # or it would serve as the nearest "plain" measurement of a batch not measured yet
    assert all(tokens <= 4 for kind, tokens, _ in times._t if kind == "plain")
    cycles = [est.cycle(tokens, 1, 2 * tokens, 1, 0) for (kind, tokens, _) in times._t if kind == "base"]
    assert cycles and min(max(c) for c in cycles) >= 0.03


def test_probes_back_off_while_they_find_nothing():
    """A probe cycle answered by plain again (once it is read) doubles the wait before the next (64, 128, ... up to
    8x); a cycle the gate chooses on its own merits brings it back to 64."""
    gate = Gate(SpecConfig(num_draft_tokens=4, gate=True))
    gate.adapter("far").ema = 0.0
    intervals = []
    for _ in range(5):
        steps = 0
        while (choice := decide(gate, ["far"])).decision is Decision.PLAIN_LOW_ACCEPTANCE:
            steps += 1
        intervals.append(steps)
        assert choice.decision is Decision.SPECULATE_PROBE and choice.lengths == (1,)
        assert gate.decisions["speculate_probe"] == len(intervals) and gate.state.name == "probe"
        gate.adapter("far").observe(drafted=1, accepted=0, weight=0.1)
        gate.state = policy.measured(gate.state, "cycle")
    assert intervals == [64, 128, 256, 512, 512]
    _, gate.state = policy._cycle(gate.state, Decision.SPECULATE, [4], gate.tuning)  # drafting pays again
    assert gate.probe_interval == 64


def test_hold_steps_follow_the_margin_of_a_plain_decision():
    """A cycle here is priced at 5.42 tokens / 200 ms (27.1 tok/s); plain at 2 tokens per plain step."""
    def decided(plain_seconds):
        gate = Gate(SpecConfig(num_draft_tokens=2, gate=True))
        gate.adapter("x").ema = 0.9
        measure(gate, "base", 2, 0, 0.040)
        measure(gate, "lora", 6, 1, 0.120)
        measure(gate, "plain", 2, 1, plain_seconds)
        choice = decide(gate, ["x", "x"])
        return choice.lengths is not None, gate.state.left if isinstance(gate.state, policy.Hold) else 0

    assert decided(0.041) == (False, 16)  # plain 80% ahead: held for the most steps
    assert decided(0.070) == (False, 2)  # 5.6% ahead: two
    assert decided(0.073) == (False, 0)  # 1% ahead: priced again at the next step
    assert decided(0.080) == (True, 0)


def _decoding(adapters: list[str]) -> list[Sequence]:
    seqs = [Sequence(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=64, ignore_eos=True), adapter=a)
            for i, a in enumerate(adapters)]
    for seq in seqs:
        seq.output_token_ids.append(4)
        seq.num_computed = 3  # its prompt's KV written: it decodes
    return seqs


def test_a_plain_hold_covers_the_batches_it_prices_alike_and_no_new_adapter():
    """After a wide-margin plain decision, the next steps stay plain without re-pricing (and without drafting
    room) while the batch is the one priced, give or take a third of its sequences (at a burst they join and
    finish at every step), and not once an adapter joins that it was not priced with, nor for a batch with more
    drafting room per sequence than the one priced (a batch near its sequences' ends would draft little)."""
    def gate_and_step():
        gate = Gate(SpecConfig(num_draft_tokens=2, gate=True))
        gate.adapter("x").ema = gate.adapter("y").ema = 0.9
        for tokens in (5, 6, 7, 8, 9):
            measure(gate, "base", tokens, 0, 0.040)
            measure(gate, "lora", 3 * tokens, 1, 0.120)
            measure(gate, "plain", tokens, 1, 0.041)  # plain far ahead: held for the most steps

        def step(seqs, lookahead):
            before = dict(gate.decisions)
            seqs = seqs if isinstance(seqs[0], Sequence) else _decoding(seqs)
            plan = gate.plan(ScheduledBatch(seqs, lookahead=lookahead))
            assert not plan.speculate
            (decision,) = [d for d, n in gate.decisions.items() if n != before.get(d, 0)]
            return decision, gate.lookahead
        return step

    step = gate_and_step()
    assert step(["x"] * 6, 2) == ("plain_cost", 0)  # priced: plain by a wide margin, no drafting room next
    assert step(["x"] * 7, 0) == ("plain_hold", 0)  # a sequence joined
    assert step(["x"] * 5, 0) == ("plain_hold", 0)  # two finished
    assert step(["x"] * 9, 0) == ("plain_unreserved", 2)  # half as large again: priced anew, once room is reserved
    assert step(["x"] * 9, 2) == ("plain_cost", 0)
    assert step(["x"] * 8, 0) == ("plain_hold", 0)
    assert step(["x"] * 8 + ["y"], 0) == ("plain_unreserved", 2)  # an adapter it was not priced with
    step = gate_and_step()
    near_end = _decoding(["x"] * 8)
    for seq in near_end:
        seq.params = SamplingParams(max_tokens=3, ignore_eos=True)  # two tokens left: one draft at most
    assert step(near_end, 2) == ("plain_cost", 0)
    assert step(near_end, 0) == ("plain_hold", 0)
    assert step(["x"] * 8, 0) == ("plain_unreserved", 2)  # the same batch with room to draft is priced again


def test_plain_held_without_repricing_and_still_plain_decodings_tokens(model):
    """An adapter the cost model keeps plain (min_acceptance 0: never gated off): after a plain decision by a wide
    margin the same batch's next steps are plain without re-pricing, and the tokens are plain decoding's."""
    path, adapters = model
    engine = LLMEngine(EngineConfig(model=path, num_kv_blocks=256,
                                    speculative=SpecConfig(num_draft_tokens=4, min_acceptance=0.0)))
    pin_times(engine, base=0.040, lora=0.120, plain=0.041)  # drafting slow, adapters nearly free: plain by far
    engine.add_adapter("far", adapters["far"])
    prompts = [[i + 1, i + 2, i + 3] for i in range(4)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    engine.generate(prompt_token_ids=prompts, sampling_params=params, adapter_names=["far"] * 4)  # learn
    out = engine.generate(prompt_token_ids=prompts, sampling_params=params, adapter_names=["far"] * 4)
    decisions = engine.stats()["speculative"]["gate_decisions"]
    assert decisions.get("plain_cost", 0) > 0 and decisions.get("plain_hold", 0) > 0
    plain = LLMEngine(EngineConfig(model=path, num_kv_blocks=256))
    plain.add_adapter("far", adapters["far"])
    ref = plain.generate(prompt_token_ids=prompts, sampling_params=params, adapter_names=["far"] * 4)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]


def test_plain_remeasured_after_a_run_of_cycles_with_back_off():
    """Plain step time is measured only in plain steps: one measured high (a collection, a one-off cost) would keep
    the gate drafting for good. After 64 cycles chosen on cost in a row one plain step re-measures it, its time
    replacing the old one; a probe answered by a cycle again doubles the wait (128), one that finds plain faster
    brings it back to 64. A cycle here: 5.42 tokens / 65 ms (83 tok/s)."""
    gate = Gate(SpecConfig(num_draft_tokens=2, gate=True))
    gate.adapter("x").ema = 0.9
    measure(gate, "base", 2, 0, 0.010)
    measure(gate, "lora", 6, 1, 0.045)
    measure(gate, "plain", 2, 1, 0.400)  # measured high once: 5 tok/s
    seqs = _decoding(["x", "x"])

    def until_plain(plain_seconds):
        cycles = 0
        while True:
            plan = gate.plan(ScheduledBatch(seqs, lookahead=2))
            gate.observe(plan, StepResult(), 0.0 if plan.speculate else plain_seconds)
            if not plan.speculate:
                return cycles, gate.last_decision, plan.remeasure
            cycles += 1

    assert until_plain(0.300) == (64, Decision.PLAIN_PROBE, True)
    assert gate.times.get("plain", 2, 1) == 0.300  # replaced, not averaged in
    assert until_plain(0.012) == (128, Decision.PLAIN_PROBE, True)  # the first probe lost: twice the wait
    plan = gate.plan(ScheduledBatch(seqs, lookahead=2))  # priced at 12 ms a plain step (167 tok/s): plain
    assert not plan.speculate and gate.last_decision is Decision.PLAIN_COST and not plan.remeasure
    assert gate.state.probes.plain_backoff == 1 and gate.decisions["plain_probe"] == 2
    streak = replace(gate.state, cycle_run=64)
    assert policy.plain_probe_due(streak, 0, gate.tuning)
    assert not policy.plain_probe_due(streak, 1, gate.tuning)  # a plain step with a prompt is not timed: no probe


def test_engine_remeasures_a_plain_time_measured_high(model):
    """Through the engine: plain priced at 50 s a step (as if measured once during a stall), drafting at 0.5 s a
    pass (the far adapter's drafts are rejected: a cycle gives a token). The gate drafts until the plain probe,
    then the probe's real plain step time prices every later decision plain (the probe judged won: no back-off);
    tokens are plain decoding's."""
    path, adapters = model
    engine = LLMEngine(EngineConfig(model=path, num_kv_blocks=256,
                                    speculative=SpecConfig(num_draft_tokens=4, min_acceptance=0.0)))
    engine.add_adapter("far", adapters["far"])
    times = pin_times(engine, base=0.5, lora=0.5, plain=50.0, still_measured=("plain",))
    engine.gate.tuning = replace(engine.gate.tuning, probe_interval=8)
    prompts = [[i + 1, i + 2, i + 3] for i in range(4)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    out = engine.generate(prompt_token_ids=prompts, sampling_params=params, adapter_names=["far"] * 4)
    decisions = engine.stats()["speculative"]["gate_decisions"]
    # (the step planned while the probe runs is priced at the old time: its time is read a step later)
    assert 8 <= decisions["speculate"] <= 9 and decisions["plain_probe"] == 1 and decisions["plain_cost"] > 0
    assert times.get("plain", 4, 1) < 5.0 and engine.gate.state.probes.plain_backoff == 1
    plain = LLMEngine(EngineConfig(model=path, num_kv_blocks=256))
    plain.add_adapter("far", adapters["far"])
    ref = plain.generate(prompt_token_ids=prompts, sampling_params=params, adapter_names=["far"] * 4)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
