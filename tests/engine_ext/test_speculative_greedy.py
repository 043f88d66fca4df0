"""Speculative LoRA-off drafting is lossless: token-for-token the plain output, greedy and (seeded) sampled
alike, since every token is drawn on the device with noise keyed by its request's seed and position. Every step
queues its passes back to back, their ids gathered on the device, and the step after it is queued before it is
read.

The suite runs on every backend (the `backend` fixture, here over WITH_FP8): the plain-torch engine on the CPU,
the same with FP8 base weights (float32 products of the widened weights: plain decoding there is the reference),
and the Triton kernels with CUDA graphs on a GPU; there too adapters swap through two slots (on the GPU against graphs
captured once) and forwards queued back to back read their ids from the device. On the GPU only: plain
decoding equals that of the plain-torch kernels run eagerly (for the Triton kernels with graphs and without),
and a step never makes the host wait for the device. The stop-string tests run on the CPU."""

import warnings

import pytest
import torch

from backends import CUDA_TORCH, CUDA_TRITON, CUDA_TRITON_GRAPHS, WITH_FP8, on_gpu, param, skip_unless_available
from char_tokenizer import add_char_tokenizer
from engine_ext import EngineConfig, LLMEngine, SamplingParams, SpecConfig, StepContext
from engine_ext.batch import ForwardInputError, SeqWork
from tiny_models import build_adapter, build_model

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Distances from the base span near (most drafts accepted) to far (most rejected).
ADAPTERS = {
    "near-r8": dict(r=8, target_modules=ALL, std=0.03),
    "mid-r16": dict(r=16, target_modules=("q_proj", "v_proj", "down_proj"), std=0.08),
    "far-r64": dict(r=64, alpha=64, target_modules=ALL, std=0.08),
    "near-r32-rslora": dict(r=32, target_modules=("q_proj", "k_proj", "o_proj"), use_rslora=True, std=0.02),
}
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17], [3, 3], [50, 60, 70], [5, 4, 3, 2, 1, 9]]
NAMES = ["near-r8", None, "mid-r16", "far-r64", "near-r32-rslora", None]
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module", params=WITH_FP8)
def backend(request) -> dict:
    """conftest's `backend`, over the FP8 engine too: speculation is lossless whatever the base weights are."""
    skip_unless_available(request.param)
    return dict(request.param)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def models(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    model = build_model(request.param, str(root / "m"))
    adapters = {n: build_adapter(model, str(root / n), seed=i, **kw) for i, (n, kw) in enumerate(ADAPTERS.items())}
    return model, adapters


@pytest.fixture(scope="module")
def setup(backend, models):
    """(model, adapters, plain decoding's tokens for PROMPTS on the backend)."""
    model, adapters = models
    plain = make_engine(model, adapters, None, **backend)
    expected = [o.token_ids for o in plain.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS,
                                                    adapter_names=NAMES)]
    return model, adapters, expected


def make_engine(model, adapters, spec, **kw):
    kw.setdefault("num_kv_blocks", 512)
    kw.setdefault("block_size", 4)
    kw.setdefault("max_loras", 4)
    engine = LLMEngine(EngineConfig(model=model, speculative=spec, **kw))
    for n, p in adapters.items():
        engine.add_adapter(n, p)
    return engine


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6])
def test_identical_to_plain_for_every_draft_length(setup, backend, k):
    model, adapters, expected = setup
    engine = make_engine(model, adapters, SpecConfig(num_draft_tokens=k, gate=False), **backend)
    outs = engine.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS, adapter_names=NAMES)
    assert [o.token_ids for o in outs] == expected
    stats = engine.stats()
    assert stats["speculative"]["draft_passes"] > 0 and stats["speculative"]["cycles"] > 0
    passes = stats["speculative"]["cycle_passes"]  # gate off: every cycle drafts k, but one that ends a sequence
    assert sum(passes.values()) == stats["speculative"]["cycles"] and max(passes, key=passes.get) == k
    near = stats["adapters"]["near-r8"]
    assert near["accepted_tokens"] > 0 and near["drafted_tokens"] >= near["accepted_tokens"]
    assert stats["free_kv_blocks"] == stats["total_kv_blocks"]


def test_identical_under_preemption(setup, backend):
    model, adapters, expected = setup
    engine = make_engine(model, adapters, SpecConfig(num_draft_tokens=4, gate=False), num_kv_blocks=16, **backend)
    outs = engine.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS, adapter_names=NAMES)
    assert [o.token_ids for o in outs] == expected
    assert engine.stats()["num_preemptions"] > 0 and engine.stats()["speculative"]["cycles"] > 0


@pytest.mark.parametrize("k", [3, 4])
def test_riders_stopping_inside_a_cycle(setup, backend, k):
    """A base-only rider's stop shows only after the cycle's sync: the tokens it computed past the stop are
    dropped, and everything else is as in plain decoding."""
    model, adapters, expected = setup
    params = []
    for tokens, name in zip(expected, NAMES):
        first_new = [i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i]]
        stop = [tokens[first_new[0]]] if name is None and first_new else []
        params.append(SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=stop))
    assert any(p.stop_token_ids for p in params)
    plain = make_engine(model, adapters, None, **backend).generate(prompt_token_ids=PROMPTS, sampling_params=params,
                                                                   adapter_names=NAMES)
    engine = make_engine(model, adapters, SpecConfig(num_draft_tokens=k, gate=False), **backend)
    spec = engine.generate(prompt_token_ids=PROMPTS, sampling_params=params, adapter_names=NAMES)
    assert [(o.token_ids, o.finish_reason) for o in spec] == [(o.token_ids, o.finish_reason) for o in plain]
    assert any(o.finish_reason == "stop" and o.adapter is None for o in spec)
    assert engine.stats()["free_kv_blocks"] == engine.stats()["total_kv_blocks"]


def test_identical_with_different_draft_lengths_per_adapter(setup, backend):
    model, adapters, expected = setup
    engine = make_engine(model, adapters, SpecConfig(num_draft_tokens=5, gate=False), **backend)
    length = {"near-r8": 1, "mid-r16": 3, "far-r64": 0, "near-r32-rslora": 5}
    engine.gate.draft_lengths = lambda names, caps, batch, left=None, ride=None: [
        min(c, length[n]) for n, c in zip(names, caps)]
    # a prompt computed in a drafting pass drafts in the passes after it: as long as its adapter's sequences do
    engine.gate.prompt_drafts = lambda s, chosen: length[s.adapter] if s.adapter else 0
    outs = engine.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS, adapter_names=NAMES)
    assert [o.token_ids for o in outs] == expected
    stats = engine.stats()
    for name, m in length.items():
        ad = stats["adapters"][name]
        assert ad["drafted_tokens"] <= m * (ad.get("verifies") or 0)
        assert (ad["drafted_tokens"] > 0) == (m > 0)


SAMPLED = SamplingParams(max_tokens=30, temperature=1.0, seed=5, ignore_eos=True)


@pytest.mark.parametrize("batch", ["greedy", "sampled"])
def test_adapter_riders_decode_in_the_drafting_passes(setup, backend, batch):
    """An adapter sequence the gate lets ride decodes with its adapter on in every drafting pass (a mixed pass:
    adapters off for the drafters, on for it) and still gives plain decoding's tokens, with a sampled request in
    the batch or not (its tokens too are plain's)."""
    model, adapters, expected = setup
    engine = make_engine(model, adapters, SpecConfig(num_draft_tokens=3, gate=False), **backend)
    engine.gate.rides = lambda s: s.adapter in ("far-r64", "mid-r16")
    engine.gate.draft_lengths = lambda names, caps, batch, left=None, ride=None: [
        0 if n in ("far-r64", "mid-r16") else c for n, c in zip(names, caps)]
    prompts, params, names = PROMPTS, [PARAMS] * len(PROMPTS), NAMES
    if batch == "sampled":
        prompts, params, names = prompts + [[2, 4, 6]], params + [SAMPLED], names + ["near-r8"]
        plain = make_engine(model, adapters, None, **backend)
        expected = [o.token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params,
                                                        adapter_names=names)]
    outs = engine.generate(prompt_token_ids=prompts, sampling_params=params, adapter_names=names)
    assert [o.token_ids for o in outs] == expected
    stats = engine.stats()
    for name in ("far-r64", "mid-r16"):  # they rode: nothing drafted, every token decoded
        assert stats["adapters"][name]["drafted_tokens"] == 0
    assert stats["adapters"]["near-r8"]["drafted_tokens"] > 0
    # drafting passes that read the riders' adapters were timed as such (the gate prices them apart)
    assert any(kind == "base" and adapters_in > 0 for kind, _, adapters_in in engine.gate.times._t)


LATE_SAMPLED = SamplingParams(max_tokens=PARAMS.max_tokens, temperature=1.0, seed=9, ignore_eos=True)


def _late_arrival_run(engine, during_the_step: bool, sampled: bool = False, late_params: SamplingParams = PARAMS):
    """Three requests decode (with `sampled`, a fourth one sampled); then one more arrives before the next step, or
    while it runs (through StepContext.arrivals, the first time the step asks, as a serving loop adds it) ->
    (the outputs of that step and the one after it (which reads it), the outputs published during them, every
    request's final tokens, prompts computed in a drafting pass meanwhile)."""
    for i in range(3):
        engine.add_request(f"r{i}", prompt_token_ids=PROMPTS[i], sampling_params=PARAMS, adapter_name=NAMES[i])
    if sampled:
        engine.add_request("sampled", prompt_token_ids=PROMPTS[3], adapter_name=NAMES[0], sampling_params=SamplingParams(
            max_tokens=PARAMS.max_tokens, temperature=1.0, seed=3, ignore_eos=True))
    started: set[str] = set()
    while len(started) < 3 + sampled:  # their prompts (on a GPU adapter copies land between steps, one at a time)
        started |= {o.request_id for o in engine.step() if o.token_ids}

    def late() -> None:  # on an adapter already in a slot (a cold one waits for its copy, whenever it arrives)
        engine.add_request("late", prompt_token_ids=PROMPTS[4], sampling_params=late_params, adapter_name=NAMES[0])

    published = []
    ctx = StepContext(publish=published.extend)
    if during_the_step:
        ctx.arrivals = lambda: engine.seqs.get("late") is None and late()
    else:
        late()
    ridden = lambda: (engine.stats().get("speculative") or {}).get("ridden_prompts", 0)  # noqa: E731
    before = ridden()
    outs = engine.step(ctx)
    ridden_in_step = ridden() - before
    outs += engine.step(StepContext(publish=published.extend))  # reads the step the arrival joined
    final = {o.request_id: o.token_ids for o in outs if o.finished}
    while engine.has_unfinished_requests:
        final |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
    return outs, published, final, ridden_in_step


@pytest.mark.parametrize("late_params", [PARAMS, LATE_SAMPLED], ids=["greedy-arrival", "sampled-arrival"])
@pytest.mark.parametrize("batch", ["greedy", "sampled"])
@pytest.mark.parametrize("k", [1, 4])
def test_a_request_arriving_during_a_cycle_rides_it_and_its_first_token_comes_before_the_cycle_ends(
        setup, backend, k, batch, late_params):
    """The new prompt runs in the next drafting pass with its adapter on (a plain step for it), drafts in the
    passes after it, and its first token is published as soon as that pass has run, before the step returns (a
    sampled arrival as well: its draws are on the device). With no drafting pass left (k = 1: asked before the
    verify pass) it runs in the verify pass. Every output is plain decoding's, the sampled requests' too."""
    model, adapters, _ = setup
    sampled = batch == "sampled"
    _, _, reference, _ = _late_arrival_run(make_engine(model, adapters, None, **backend), False, sampled,
                                           late_params)
    engine = make_engine(model, adapters, SpecConfig(num_draft_tokens=k, gate=False), **backend)
    outs, published, final, ridden = _late_arrival_run(engine, True, sampled, late_params)
    late = [o for o in outs if o.request_id == "late"]
    early = [o for o in published if o.request_id == "late"]
    spec = engine.stats()["speculative"]
    assert spec["joined"] == 1
    if k > 1:  # joined before pass 1: its prompt ran there; it drafted in the k - 2 passes left, and the verify
        # pass checked them: its first token, the drafts accepted and the verify pass's own token
        assert [len(o.new_token_ids) for o in early] == [1] and ridden == 1
        assert len(late) == 1 and 2 <= len(late[0].token_ids) <= k
        assert late[0].new_token_ids == late[0].token_ids[1:]
    else:
        assert early == [] and ridden == 0
        assert len(late) == 1 and len(late[0].token_ids) == 1
    assert final == reference
    assert engine.stats()["free_kv_blocks"] == engine.stats()["total_kv_blocks"]


def test_prompts_run_in_the_first_drafting_pass(setup, backend):
    """Requests admitted at a cycle's start compute their prompts in its first drafting pass, with their adapter
    on, then draft (base-only ones ride) in the passes after it: more than one token in their first step, plain's
    tokens."""
    model, adapters, expected = setup
    engine = make_engine(model, adapters, SpecConfig(num_draft_tokens=3, gate=False), **backend)
    engine.add_request("first", prompt_token_ids=PROMPTS[0], sampling_params=PARAMS, adapter_name=NAMES[0])
    while not any(o.token_ids for o in engine.step()):  # it decodes: the next step can draft
        pass
    for i in range(1, len(PROMPTS)):
        engine.add_request(f"r{i}", prompt_token_ids=PROMPTS[i], sampling_params=PARAMS, adapter_name=NAMES[i])
    while engine.stats()["speculative"]["ridden_prompts"] == 0:
        engine.step()
    outs = {o.request_id: o for o in engine.step()}  # reads the step that ran them
    started = [o for o in outs.values() if o.request_id != "first"]
    assert started and all(2 <= len(o.token_ids) <= 4 for o in started)  # first token, drafts accepted, verify's
    base_only = [o for o in started if o.adapter is None]
    assert base_only and all(len(o.token_ids) == 4 for o in base_only)  # prompt pass, two rider passes, verify
    final = {o.request_id: o.token_ids for o in outs.values() if o.finished}
    while engine.has_unfinished_requests:
        final |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
    assert [final[f"r{i}"] for i in range(1, len(PROMPTS))] == expected[1:]
    assert final["first"] == expected[0]


@pytest.mark.parametrize("k", [1, 3])
def test_sampled_requests_draft_and_give_plain_decodings_tokens(setup, backend, k):
    """Seeded sampled requests (top-k, top-p, min-p among them) draft and ride like greedy ones, and every one
    gives exactly plain decoding's tokens: draft and target draw at a position with the same noise."""
    model, adapters, _ = setup
    params = [SamplingParams(max_tokens=16, temperature=0.8, seed=i, ignore_eos=True, top_k=(0, 5)[i % 2] or -1,
                             top_p=(1.0, 0.9)[i % 2], min_p=(0.0, 0.05)[i % 3 == 0]) for i in range(len(PROMPTS))]
    plain = make_engine(model, adapters, None, **backend).generate(prompt_token_ids=PROMPTS, sampling_params=params,
                                                                   adapter_names=NAMES)
    engine = make_engine(model, adapters, SpecConfig(num_draft_tokens=k, gate=False), **backend)
    outs = engine.generate(prompt_token_ids=PROMPTS, sampling_params=params, adapter_names=NAMES)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    near = engine.stats()["adapters"]["near-r8"]
    assert near["drafted_tokens"] > 0 and near["accepted_tokens"] > 0


def test_returned_logits_match_plain_decoding(setup, backend):
    """Riders' rows are kept from each drafting pass before the next pass reuses the forward's output (a
    graph's output buffer on the GPU)."""
    model, adapters, _ = setup
    params = SamplingParams(max_tokens=10, ignore_eos=True, return_logits=True)
    names = ["near-r8", None, "mid-r16"]
    plain = make_engine(model, adapters, None, **backend).generate(prompt_token_ids=PROMPTS[:3],
                                                                   sampling_params=params, adapter_names=names)
    engine = make_engine(model, adapters, SpecConfig(num_draft_tokens=3, gate=False), **backend)
    spec = engine.generate(prompt_token_ids=PROMPTS[:3], sampling_params=params, adapter_names=names)
    assert engine.stats()["speculative"]["cycles"] > 0
    # The GPU kernels reduce in a different order for a verify pass than for a decode step.
    tol = 1e-3 if on_gpu(backend) else 1e-4
    for a, b in zip(plain, spec):
        assert b.token_ids == a.token_ids
        torch.testing.assert_close(b.logits, a.logits, rtol=tol, atol=tol)


def test_run_reads_input_ids_from_the_device(setup, backend):
    """The runner API the one-sync cycle is built on: token ids taken from a device tensor at run time."""
    model, adapters, _ = setup
    engine = make_engine(model, adapters, None, **backend)
    runner, slots = engine.runner, engine.adapters.slots
    engine.generate(prompt_token_ids=[[1]], sampling_params=SamplingParams(max_tokens=1), adapter_names=["near-r8"])
    lora = engine.adapters.slot_of("near-r8")
    prefill = [SeqWork([1, 2, 3, 4, 5], 0, [0, 1, 2], lora), SeqWork([7, 8, 9], 0, [3, 4], slots.zero_slot)]
    runner.run(prefill, slots)
    tokens = torch.tensor([50, 61, 72, 83], device=backend.get("device", "cpu"))
    placeholders = [SeqWork([0, 9, 0], 5, [0, 1, 2], lora, num_logits=3), SeqWork([0], 3, [3, 4], slots.zero_slot)]
    # owned=False: in the model's dtype, and on the GPU a view of the graph's output, which the next replay overwrites
    got = runner.run(placeholders, slots, tokens=tokens, token_src=[2, -1, 0, 3], owned=False).to(torch.float32,
                                                                                                   copy=True)
    runner.run(prefill, slots)  # the same cache state again
    owned = runner.run(placeholders, slots, tokens=tokens, token_src=[2, -1, 0, 3])
    runner.run(prefill, slots)
    work = [SeqWork([72, 9, 50], 5, [0, 1, 2], lora, num_logits=3), SeqWork([83], 3, [3, 4], slots.zero_slot)]
    want = runner.run(work, slots)
    assert owned.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(owned, want, rtol=0, atol=0)


def test_queued_forwards_read_ids_written_by_earlier_ones(setup, backend):
    """Three decode steps and a verify-shaped adapter pass queued with no sync (graph replays on the GPU), each
    taking ids from the previous one's argmax on the device, equal the same steps run one by one."""
    model, adapters, _ = setup
    engine = make_engine(model, adapters, None, **backend)
    runner, slots = engine.runner, engine.adapters.slots
    engine.generate(prompt_token_ids=[[1]], sampling_params=SamplingParams(max_tokens=1), adapter_names=["near-r8"])
    lora, zero = engine.adapters.slot_of("near-r8"), slots.zero_slot
    prompts, tables = [[1, 2, 3, 4, 5], [7, 8, 9]], [[0, 1, 2], [3, 4, 5]]

    def prefill():
        return runner.run([SeqWork(p, 0, t, zero) for p, t in zip(prompts, tables)], slots)

    def verify(ids):  # [a, 17] on the adapter for the first sequence, [b] base-only for the second
        return [SeqWork([ids[0], 17], 8, tables[0], lora, num_logits=2), SeqWork([ids[1]], 6, tables[1], zero)]

    ids, ref = prefill().argmax(-1).tolist(), []
    for j in range(3):
        logits = runner.run([SeqWork([ids[i]], len(p) + j, t, zero) for i, (p, t) in enumerate(zip(prompts, tables))],
                            slots, use_lora=False)
        ref.append(logits)
        ids = logits.argmax(-1).tolist()
    ref.append(runner.run(verify(ids), slots))

    tokens = torch.empty(8, dtype=torch.long, device=backend.get("device", "cpu"))
    tokens[:2] = prefill().argmax(-1)
    got = []
    for j in range(3):
        work = [SeqWork([0], len(p) + j, t, zero) for p, t in zip(prompts, tables)]
        logits = runner.run(work, slots, use_lora=False, tokens=tokens, token_src=[2 * j, 2 * j + 1], owned=False)
        torch.argmax(logits, dim=-1, out=tokens[2 * j + 2 : 2 * j + 4])
        got.append(logits.clone())
    got.append(runner.run(verify([0, 0]), slots, tokens=tokens, token_src=[6, -1, 7], owned=False).clone())
    if on_gpu(backend):
        torch.cuda.synchronize()
    for a, b in zip(ref, got):
        torch.testing.assert_close(b.float(), a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", [None, SpecConfig(num_draft_tokens=3, gate=False), SpecConfig(num_draft_tokens=2)],
                         ids=["plain", "spec-k3", "spec-k2-gated"])
def test_identical_with_adapters_swapping_through_two_slots(setup, backend, spec):
    """Four adapters through two slots: the batch's adapter mix changes many times, against CUDA graphs
    captured once."""
    model, adapters, expected = setup
    engine = make_engine(model, adapters, spec, max_loras=2, **backend)
    outs = engine.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS, adapter_names=NAMES)
    assert [o.token_ids for o in outs] == expected
    assert sum(a["loads"] for a in engine.stats()["adapters"].values()) > len(ADAPTERS) - 1
    if backend.get("cuda_graphs"):
        graphs = engine.runner.graphs
        assert graphs.capture_seconds is not None and len(graphs.graphs) == len(graphs.kinds())


@pytest.mark.parametrize("backend", [param(CUDA_TRITON, "cuda-triton"),
                                     param(CUDA_TRITON_GRAPHS, "cuda-triton-graphs")], indirect=True)
def test_plain_decoding_equals_the_plain_torch_kernels(setup, backend):
    """The backend's kernels (with or without graphs) give the tokens of the plain-torch kernels run eagerly on
    the same device, with the adapters swapping through two slots."""
    model, adapters, expected = setup
    for config in (backend, CUDA_TORCH):
        engine = make_engine(model, adapters, None, max_loras=2, **config)
        outs = engine.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS, adapter_names=NAMES)
        assert [o.token_ids for o in outs] == expected


@pytest.mark.parametrize("backend", [param(CUDA_TRITON_GRAPHS, "cuda-triton-graphs")], indirect=True)
@pytest.mark.parametrize("spec", [None, SpecConfig(num_draft_tokens=3, gate=False)], ids=["plain", "spec-k3"])
def test_a_step_never_makes_the_host_wait_for_the_device(setup, backend, spec):
    """Every operation that makes the host wait for the device warns under sync debug mode: once the graphs are
    captured, a step has none (it queues the next step, then reads the one before through an event), but for the
    one that admits the new batch (measured on the H200: once)."""
    model, adapters, expected = setup
    engine = make_engine(model, adapters, spec, **backend)
    engine.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS, adapter_names=NAMES)  # capture, loads
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt_token_ids=prompt, sampling_params=PARAMS, adapter_name=NAMES[i])
    syncs, final = [], {}
    while engine.has_unfinished_requests:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                outs = engine.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs.append(sum("synchroniz" in str(w.message) for w in caught))
        final |= {o.request_id: o.token_ids for o in outs if o.finished}
    assert [final[f"r{i}"] for i in range(len(PROMPTS))] == expected
    assert len(syncs) > 3 and syncs[0] <= 1 and sum(syncs[1:]) == 0, f"host syncs per step: {syncs}"


def test_identical_with_gate_on(setup, backend):
    model, adapters, expected = setup
    engine = make_engine(model, adapters, SpecConfig(num_draft_tokens=4, gate=True), **backend)
    outs = engine.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS, adapter_names=NAMES)
    assert [o.token_ids for o in outs] == expected
    decisions = engine.stats()["speculative"]["gate_decisions"]
    assert decisions and sum(decisions.values()) <= engine.stats()["num_steps"]


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 4, 5, 6, 7, 10])
def test_max_tokens_inside_accepted_run(setup, backend, max_tokens):
    model, adapters, _ = setup
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    names = ["near-r8", "near-r32-rslora", None]
    prompts = PROMPTS[:3]
    plain = make_engine(model, adapters, None, **backend).generate(prompt_token_ids=prompts, sampling_params=params,
                                                                   adapter_names=names)
    engine = make_engine(model, adapters, SpecConfig(num_draft_tokens=6, gate=False), **backend)
    spec = engine.generate(prompt_token_ids=prompts, sampling_params=params, adapter_names=names)
    for a, b in zip(plain, spec):
        assert b.token_ids == a.token_ids and len(b.token_ids) == max_tokens and b.finish_reason == "length"


@pytest.fixture(scope="module", params=[1, 3])
def text_setup(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    model = add_char_tokenizer(build_model("llama", str(root / "m"), vocab_size=31, seed=request.param))
    adapters = {"near": build_adapter(model, str(root / "near"), seed=3, r=8, target_modules=ALL, std=0.02)}
    return model, adapters


def test_stop_strings_and_tokens_inside_accepted_runs(text_setup):
    model, adapters = text_setup
    prompt = "the quick brown fox"
    greedy = SamplingParams(max_tokens=30, ignore_eos=True)
    free = make_engine(model, adapters, None).generate(prompts=[prompt], sampling_params=greedy,
                                                       adapter_names=["near"])[0]
    # Greedy text of a random tiny model runs in long letter runs ("xxxrrrrrdddd"): stop where the last run starts.
    cut = max(i for i in range(len(free.text) - 1) if free.text[i] != free.text[i + 1])
    stop, stop_id = free.text[cut : cut + 2], free.token_ids[cut + 1]
    for params in (SamplingParams(max_tokens=30, ignore_eos=True, stop=[stop]),
                   SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id])):
        plain_engine = make_engine(model, adapters, None)
        spec_engine = make_engine(model, adapters, SpecConfig(num_draft_tokens=6, gate=False))
        a = plain_engine.generate(prompts=[prompt], sampling_params=params, adapter_names=["near"])[0]
        streamed = stream(spec_engine, prompt, params)
        b = streamed[-1]
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
        assert a.finish_reason == "stop" and len(a.token_ids) < 30
        assert [t for o in streamed for t in o.new_token_ids] == a.token_ids  # same tokens, same order
        assert "".join(o.delta_text for o in streamed) == a.text
        assert spec_engine.stats()["adapters"]["near"]["mean_accepted_length"] > 1  # runs were accepted


def stream(engine, prompt, params):
    engine.add_request("r", prompt=prompt, sampling_params=params, adapter_name="near")
    outs = []
    while engine.has_unfinished_requests:
        outs.extend(engine.step())
    return outs


def _paced_run(model, adapters, backend, params, prompts, limit):
    """Request 0 decoding, then the others arriving together, on a speculating engine whose passes take prompts up
    to `limit` tokens: (final token ids by request, (tokens, rows) of each forward after the arrivals, stats)."""
    engine = make_engine(model, adapters, SpecConfig(num_draft_tokens=2, gate=False), **backend)
    engine.generate(prompt_token_ids=[[1]] * len(ADAPTERS), sampling_params=SamplingParams(max_tokens=1),
                    adapter_names=list(ADAPTERS))  # every adapter in a slot: the arrivals are admitted together
    engine.executor.pass_tokens = limit
    sizes, launch = [], engine.runner.launch

    def counting(work, *args, **kw):  # each forward's tokens and its rows, then the real forward
        sizes.append((sum(len(w.token_ids) for w in work), len(work)))
        return launch(work, *args, **kw)

    engine.runner.launch = counting
    engine.add_request("r0", prompt_token_ids=prompts[0], sampling_params=params[0], adapter_name=NAMES[0])
    while not any(o.token_ids for o in engine.step()):  # it decodes: the next step is a cycle
        pass
    sizes.clear()
    for i in range(1, len(prompts)):
        engine.add_request(f"r{i}", prompt_token_ids=prompts[i], sampling_params=params[i], adapter_name=NAMES[i])
    final = {}
    while engine.has_unfinished_requests:
        final |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
    assert engine.stats()["free_kv_blocks"] == engine.stats()["total_kv_blocks"]
    return final, sizes, engine.stats()["speculative"]


@pytest.mark.parametrize("batch", ["greedy", "sampled"])
def test_prompts_wait_for_a_pass_with_room(setup, backend, batch):
    """With a pass limit (the largest CUDA graph's tokens, here set small), a prompt that would push a pass past it
    waits for the next pass with room, or for the next step when none of the cycle's passes has room (the verify
    pass included). Prompts that the cycle's passes could not hold all run at once (as in a burst), in one pass
    past the limit. Outputs stay plain's."""
    model, adapters, _ = setup
    prompts = [p * 4 for p in PROMPTS]  # 8-32 tokens each; the five arrivals 88
    params = [PARAMS] * len(prompts)
    if batch == "sampled":
        params[0] = SamplingParams(max_tokens=PARAMS.max_tokens, temperature=1.0, seed=3, ignore_eos=True)
    plain = make_engine(model, adapters, None, **backend)
    expected = [o.token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params,
                                                    adapter_names=NAMES)]
    # 40 tokens: above any verify pass here (6 sequences x 3 tokens), below the arrivals together; the first
    # pass's room and the next two passes' hold them
    final, sizes, spec = _paced_run(model, adapters, backend, params, prompts, 40)
    assert spec["paced_prompts"] >= 2
    assert max(n for n, _ in sizes) <= 40
    assert [final[f"r{i}"] for i in range(len(prompts))] == expected
    # 12 tokens: the passes left could not hold them: the first takes them all
    final, sizes, spec = _paced_run(model, adapters, backend, params, prompts, 12)
    assert spec["paced_prompts"] == 0
    assert max(n for n, _ in sizes) >= 88
    assert [final[f"r{i}"] for i in range(1, len(prompts))] == expected[1:]


def test_a_relaunched_pass_equals_the_pass_packed_anew(setup, backend):
    """ModelRunner.relaunch, what a drafting pass after one with the same rows runs: the last forward queued
    again from the device (positions one on, ids from its own draws, the same adapter slots) equals each pass
    packed from its work; one row rides on its adapter, one drafts on the base."""
    model, adapters, _ = setup
    engine = make_engine(model, adapters, None, **backend)
    runner, slots = engine.runner, engine.adapters.slots
    engine.generate(prompt_token_ids=[[1]], sampling_params=SamplingParams(max_tokens=1), adapter_names=["near-r8"])
    lora, zero = engine.adapters.slot_of("near-r8"), slots.zero_slot
    prompts, tables, on = [[1, 2, 3, 4, 5], [7, 8, 9]], [[0, 1, 2], [3, 4, 5]], [lora, zero]

    def prefill():
        return runner.run([SeqWork(p, 0, t, s) for p, t, s in zip(prompts, tables, on)], slots)

    ids, ref = prefill().argmax(-1).tolist(), []
    for j in range(4):
        logits = runner.run([SeqWork([ids[i]], len(p) + j, t, s) for i, (p, t, s) in enumerate(zip(prompts, tables, on))],
                            slots)
        ref.append(logits)
        ids = logits.argmax(-1).tolist()

    tokens = torch.empty(10, dtype=torch.long, device=backend.get("device", "cpu"))
    tokens[:2] = prefill().argmax(-1)
    got = []
    for j in range(4):
        if j == 0:
            work = [SeqWork([0], len(p), t, s) for p, t, s in zip(prompts, tables, on)]
            logits, positions = runner.launch(work, slots, tokens=tokens, token_src=[0, 1], owned=False)
        else:
            logits, positions = runner.relaunch(slots, tokens, 2 * j, owned=False)  # pass j - 1 drew into 2j, 2j + 1
        assert positions.tolist() == [len(p) + j for p in prompts]
        torch.argmax(logits, dim=-1, out=tokens[2 * j + 2 : 2 * j + 4])
        got.append(logits.clone())
    if on_gpu(backend):
        torch.cuda.synchronize()
    for a, b in zip(ref, got):
        torch.testing.assert_close(b.float(), a, rtol=1e-5, atol=1e-5)


def test_relaunch_refuses_what_does_not_continue_the_last_forward(setup, backend):
    """Debug mode checks the executor's premise: the work a relaunch stands for is the last forward's a position
    on; and a forward of several tokens per sequence cannot be relaunched."""
    model, adapters, _ = setup
    engine = make_engine(model, adapters, None, debug_checks=True, **backend)
    runner, slots = engine.runner, engine.adapters.slots
    zero = slots.zero_slot
    tokens = torch.zeros(8, dtype=torch.long, device=backend.get("device", "cpu"))
    runner.launch([SeqWork([1, 2, 3], 0, [0], zero)], slots)
    with pytest.raises(ValueError, match="one token per sequence"):
        runner.relaunch(slots, tokens, 0)
    runner.launch([SeqWork([4], 3, [0, 1], zero)], slots)
    with pytest.raises(ForwardInputError, match="not the last one a position on"):
        runner.relaunch(slots, tokens, 0, expect=[SeqWork([0], 5, [0, 1], zero)])
    runner.relaunch(slots, tokens, 0, expect=[SeqWork([0], 4, [0, 1], zero)])
