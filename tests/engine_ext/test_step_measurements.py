"""What a step reports to the gate (speculation.StepResult), a plain step and a cycle alike: every forward it ran as
(kind, tokens, adapters, device seconds), its span its own (the host's work between forwards outside it), and the
host's own time for the step (`host_s`: scheduling, packing, launching, reading; device waits excluded)."""

import time

import pytest

from engine_ext import EngineConfig, LLMEngine, SamplingParams, SpecConfig, StepContext
from tiny_models import build_adapter, build_model

GAP = 0.05  # seconds the serving loop's arrivals callback sleeps: between a cycle's forwards


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("measure")
    m = build_model("llama", str(root / "m"))
    return m, {name: build_adapter(m, str(root / name), seed=i, r=8, std=0.01) for i, name in enumerate("ab")}


def observed(model, backend, spec, ctx=None, max_tokens=6):
    """Run four requests (on adapters a, b, none and a) to their end; -> every (plan, result, seconds) the gate was
    given, and the run's wall time."""
    path, adapters = model
    engine = LLMEngine(EngineConfig(model=path, num_kv_blocks=256, speculative=spec, **backend))
    for name, p in adapters.items():
        engine.add_adapter(name, p)
    seen = []
    observe = engine.gate.observe
    engine.gate.observe = lambda plan, result, seconds: (seen.append((plan, result, seconds)),
                                                         observe(plan, result, seconds))
    names = ["a", "b", None, "a"]
    for i, name in enumerate(names):
        engine.add_request(f"r{i}", prompt_token_ids=[i + 1, i + 2, i + 3], adapter_name=name,
                           sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    began = time.perf_counter()
    while engine.has_unfinished_requests:
        engine.step(ctx)
    return seen, time.perf_counter() - began


def check_common(seen, wall, cpu):
    assert seen
    for plan, result, seconds in seen:
        assert len(result.passes) == plan.passes + 1  # the drafting passes, then the verify (or plain) forward
        assert all(span > 0 and tokens > 0 for _, tokens, _, span in result.passes)
        assert result.host_s > 0
        if cpu:  # a forward runs on the host as it is queued: its time is the host's too
            assert result.host_s >= sum(p[3] for p in result.passes)
    assert sum(r.host_s for _, r, _ in seen) <= wall


def test_a_plain_step_reports_its_one_forward(model, backend):
    seen, wall = observed(model, backend, None)
    check_common(seen, wall, backend.get("device", "cpu") == "cpu")
    assert [r.passes[0][0] for _, r, _ in seen[:1]] == ["prompted"]  # the first step computes prompts
    assert "plain" in {r.passes[0][0] for _, r, _ in seen}
    for plan, result, _ in seen:
        kind, tokens, adapters, _ = result.passes[0]
        # a row a token (a plain decoding step), or prompts in it
        assert kind == ("plain" if tokens == len(plan.seqs) else "prompted")
        assert adapters == len({s.adapter for s in plan.seqs} - {None})
        assert not plan.speculate and not result.verifies


def test_a_cycle_reports_each_pass_and_its_verified_drafts(model, backend):
    seen, wall = observed(model, backend, SpecConfig(num_draft_tokens=3, gate=False), max_tokens=12)
    check_common(seen, wall, backend.get("device", "cpu") == "cpu")
    cycles = [(plan, result) for plan, result, _ in seen if plan.speculate]
    assert cycles
    for plan, result in cycles:
        kinds = [p[0] for p in result.passes]
        assert set(kinds[:-1]) <= {"base", "prompted"} and kinds[-1] in {"lora", "prompted"}
        assert result.verifies and all(name in "ab" for name, _, _ in result.verifies)
        assert all(0 <= accepted <= drafted <= 3 for _, drafted, accepted in result.verifies)


def test_a_pass_span_leaves_out_the_host_work_between_forwards(model, backend):
    """The serving loop's arrivals callback runs between a cycle's forwards (here sleeping GAP each time): it is
    the host's time, in host_s, and in no forward's span. (On a CPU a forward's own time is the host's too, so
    host_s holds both; on a GPU, once the first forwards are past, each span is well under GAP.)"""
    cpu = backend.get("device", "cpu") == "cpu"
    seen, wall = observed(model, backend, SpecConfig(num_draft_tokens=3, gate=False),
                          StepContext(arrivals=lambda: time.sleep(GAP)), max_tokens=12)
    check_common(seen, wall, cpu)
    cycles = [(i, result) for i, (plan, result, _) in enumerate(seen) if plan.passes >= 2]
    assert cycles
    for i, result in cycles:
        gaps = len(result.passes) - 1  # before every drafting pass but the first, and before the verify pass
        spans = [p[3] for p in result.passes]
        assert result.host_s >= gaps * GAP + (sum(spans) if cpu else 0.0)
        if not cpu and i >= 2:
            assert max(spans) < GAP


def test_a_plain_steps_span_leaves_out_its_packing_and_a_cycles_first_pass_keeps_it(model, backend, monkeypatch):
    """Packing a forward (here made to sleep GAP) is host work: in a plain step's span it is not (plain steps overlap
    one another, so a run of them does not wait for it), while a cycle's packed passes keep it (every cycle waits
    for its verify before the next is packed: the device idles through it). Relaunched drafting passes pack
    nothing."""
    import engine_ext.cuda_graphs as cuda_graphs
    import engine_ext.model_runner as model_runner

    for module, name in ((model_runner, "build_forward_batch"), (cuda_graphs, "pack_forward")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, **kw: (time.sleep(GAP), real(*a, **kw))[1])
    cpu = backend.get("device", "cpu") == "cpu"
    plain, _ = observed(model, backend, None)
    spans = [r.passes[0][3] for _, r, _ in plain if r.passes[0][0] == "plain"]
    assert spans and max(spans) < GAP
    cycles, _ = observed(model, backend, SpecConfig(num_draft_tokens=3, gate=False), max_tokens=12)
    firsts = [r.passes[0][3] for plan, r, _ in cycles if plan.speculate and r.passes[0][0] == "base"]
    assert firsts and min(firsts) >= GAP * (1.0 if cpu else 0.5)


def test_a_step_queued_behind_another_reports_its_period(model, backend):
    """`period_s`: from the end of the step queued before it to its own end, what the loop spent on it: every
    forward of it and what the device waited for in between (here the arrivals callback's sleep, GAP before each
    of a cycle's forwards but the first), so at least its spans and those waits. The first step, queued behind
    none, reports none."""
    cpu = backend.get("device", "cpu") == "cpu"
    seen, _ = observed(model, backend, SpecConfig(num_draft_tokens=3, gate=False),
                       StepContext(arrivals=lambda: time.sleep(GAP)), max_tokens=12)
    assert seen[0][1].period_s == 0.0
    timed = [(plan, r) for plan, r, _ in seen[1:] if r.period_s > 0]
    assert len(timed) >= len(seen) // 2, [r.period_s for _, r, _ in seen]
    for plan, r in timed:
        waits = (len(r.passes) - 1) * GAP if plan.passes >= 2 else 0.0
        assert r.period_s >= sum(p[3] for p in r.passes) * (1.0 if cpu else 0.9) + waits * (1.0 if cpu else 0.5)
