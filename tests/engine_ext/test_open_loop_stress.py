"""The engine under randomized open-loop traffic: requests arriving between and during steps, prompt and
output lengths that vary, more adapters than device slots, base-only requests, aborts part-way and
preemption (a KV cache too small for everything at once), with speculation off, gated and forced, and
every forward's indices bounds-checked on the host (`debug_checks`). Every request must finish, the KV
cache must come back whole, and greedy outputs must equal plain decoding's token for token.

Runs on every backend (the `backend` fixture): the plain-torch engine on the CPU, and the Triton kernels with
CUDA graphs on a GPU (marked `gpu`, run on the device)."""

import dataclasses

import pytest

from bench.serve_load import StepClock, replay
from bench.traffic import TrafficConfig, generate
from engine_ext import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from tiny_models import build_adapter, build_model

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Nine adapters over three device slots, near to far from the base, ranks 4 to 32.
ADAPTERS = {f"ad{i}": dict(r=(4, 8, 16, 32)[i % 4], target_modules=ALL if i % 2 else ("q_proj", "v_proj"),
                           std=(0.01, 0.03, 0.08)[i % 3]) for i in range(9)}
# The draft_lead variants: the host waiting for each pass (0), and planning a cycle's passes with up to three queued
# ahead of the device, its prompts' first tokens mostly handed out at the cycle's end (3).
MODES = {"plain": None, "gated-k4": SpecConfig(num_draft_tokens=4), "forced-k3": SpecConfig(num_draft_tokens=3, gate=False),
         "gated-k4-lead0": SpecConfig(num_draft_tokens=4, draft_lead=0),
         "forced-k4-lead3": SpecConfig(num_draft_tokens=4, gate=False, draft_lead=3)}


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    """One torch thread here (and so in each process it starts: see conftest.one_torch_thread)."""


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    root = tmp_path_factory.mktemp("open-loop")
    model = build_model("llama", str(root / "m"))
    adapters = {n: build_adapter(model, str(root / n), seed=i, **kw) for i, (n, kw) in enumerate(ADAPTERS.items())}
    traffic = TrafficConfig(num_requests=48, arrival="gamma", rate=40.0, cv=2.0, adapters=tuple(adapters),
                            popularity="zipf:1.0", base_share=0.2, prompt_len=(2, 40), output_len=(4, 28),
                            vocab=211, abort_share=0.15, seed=7)
    return model, adapters, generate(traffic)


def _run(workload, backend, spec, caching=False):
    model, adapters, requests = workload
    # 44 blocks of 4 tokens: room for a handful of the longest requests at once, so some are preempted
    engine = LLMEngine(EngineConfig(model=model, dtype="float32", max_loras=3, block_size=4, num_kv_blocks=44,
                                    max_model_len=128, max_num_seqs=16, speculative=spec, debug_checks=True,
                                    enable_prefix_caching=caching, **backend))
    for n, p in adapters.items():
        engine.add_adapter(n, p)
    # each time a cycle takes arrivals in between passes, 2 ms pass: requests land during cycles and join them
    records = replay(engine, requests, StepClock(dt=0.01, pass_dt=0.002),
                     lambda r: SamplingParams(max_tokens=r.max_tokens, ignore_eos=True), max_steps=5000)
    return engine, records


@pytest.fixture(scope="module")
def plain_reference():
    return {}


@pytest.mark.parametrize("mode", list(MODES))
def test_every_request_finishes_and_greedy_output_equals_plain(workload, backend, mode, plain_reference):
    key = tuple(sorted(backend))
    if key not in plain_reference:
        plain_reference[key] = _run(workload, backend, None)[1]
    reference = {r.request.request_id: r for r in plain_reference[key]}
    engine, records = _run(workload, backend, MODES[mode])

    assert all(r.error is None for r in records), [r.error for r in records if r.error][:3]
    assert all(r.finish_reason in ("length", "abort") for r in records)  # all finished (the replay ended)
    for r in records:
        ref = reference[r.request.request_id]
        if r.request.abort_after is None:
            assert r.finish_reason == "length" and len(r.token_ids) == r.request.max_tokens
            assert r.token_ids == ref.token_ids, f"{r.request.request_id} on {r.request.adapter} differs from plain"
        else:  # aborted part-way (or finished in the step that crossed the abort point): a prefix of the same text
            n = min(len(r.token_ids), len(ref.token_ids))
            assert r.token_ids[:n] == ref.token_ids[:n]
    stats = engine.stats()
    assert stats["free_kv_blocks"] == stats["total_kv_blocks"] and not engine.has_unfinished_requests
    # The traffic did what it is for: adapters swapped through the slots and sequences were preempted.
    assert sum(a["loads"] for a in stats["adapters"].values()) > engine.config.max_loras
    assert stats["num_preemptions"] > 0
    if MODES[mode] is not None:
        assert stats["speculative"]["cycles"] > 0
        if not MODES[mode].gate:  # every step a cycle: requests arrived during cycles and joined them (how many
            # cycles the gate runs depends on the pass times it measures on the device)
            assert stats["speculative"]["joined"] > 0


@pytest.fixture(scope="module")
def shared_workload(workload):
    """The same traffic with each adapter's (and the base model's) own 18-token system prompt before every prompt."""
    model, adapters, requests = workload
    names = sorted(adapters) + [None]
    system = {a: [(7 * i + 3 * j) % 200 + 1 for j in range(18)] for i, a in enumerate(names)}
    return model, adapters, [dataclasses.replace(r, prompt=system[r.adapter] + r.prompt) for r in requests]


@pytest.mark.parametrize("mode", ["plain", "forced-k3"])
def test_prefix_caching_under_open_loop_traffic_keeps_every_greedy_output(shared_workload, backend, mode):
    """Shared system prompts under the same arrivals, aborts and preemption: with prefix caching on, every output is
    the uncached plain engine's, hits happen, and the cache comes back whole (cached blocks count as free)."""
    reference = {r.request.request_id: r for r in _run(shared_workload, backend, None)[1]}
    engine, records = _run(shared_workload, backend, MODES[mode], caching=True)
    for r in records:
        ref = reference[r.request.request_id]
        n = len(r.token_ids) if r.request.abort_after is None else min(len(r.token_ids), len(ref.token_ids))
        assert r.token_ids[:n] == ref.token_ids[:n], f"{r.request.request_id} on {r.request.adapter} differs"
        if r.request.abort_after is None:
            assert r.finish_reason == "length" and len(r.token_ids) == r.request.max_tokens
    stats = engine.stats()
    assert stats["free_kv_blocks"] == stats["total_kv_blocks"] and not engine.has_unfinished_requests
    assert stats["prefix_cache"]["hits"] > 0 and stats["num_preemptions"] > 0


def test_traffic_is_seeded_and_follows_its_arrival_process():
    cfg = TrafficConfig(num_requests=2000, arrival="poisson", rate=50.0, adapters=("a", "b", "c"), seed=3)
    a, b = generate(cfg), generate(cfg)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    gaps = [y.arrival - x.arrival for x, y in zip(a, a[1:])]
    assert abs(sum(gaps) / len(gaps) - 1 / 50) < 0.002  # mean gap 1/rate
    share = sum(r.adapter is None for r in a) / len(a)
    assert abs(share - 0.2) < 0.03
    counts = [sum(r.adapter == n for r in a) for n in "abc"]
    assert counts[0] > counts[1] > counts[2]  # Zipf: the first adapter is the most popular
    burst = generate(TrafficConfig(num_requests=5, arrival="burst", adapters=("a",)))
    assert {r.arrival for r in burst} == {0.0}
    with pytest.raises(ValueError, match="popularity"):
        TrafficConfig(adapters=("a",), popularity="pareto:2")
