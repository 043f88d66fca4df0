"""Tensor parallelism on the CPU: an engine with tensor_parallel_size=2 (gloo, rank 0 here and one spawned worker
process) gives token for token the greedy output of the one-rank engine in float32, with plain steps and with
speculative drafting, over adapters of ranks 8 and 16 (attention-only and all seven projections, swapping through
fewer slots than adapters) and base-only requests, under preemption and after an adapter is removed; a model with
fewer KV heads than ranks (one, replicated) and q/k/v biases too. A rank that dies fails the engine within seconds
with an error naming it, and every step after that fails at once. On two GPUs (marked gpu): the same with the Triton
kernels and CUDA graphs over NCCL.

The layout's pure parts (which rows and columns each rank holds) are pinned by reassembling the whole model's
tensors from the ranks' parts."""

import os
import signal
import threading
import time

import pytest
import torch

from engine_ext import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from engine_ext.lora_adapter import LoRAWeights
from engine_ext.model_config import load_model_spec
from engine_ext.parallel.layout import ShardLayout, check_tensor_parallel
from engine_ext.parallel.leader import RankFailure
from tiny_models import build_adapter, build_model

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
ADAPTERS = {
    "all-r8": dict(r=8, target_modules=ALL, std=0.05),
    "attn-r16": dict(r=16, target_modules=ATTN),
    "all-r16": dict(r=16, target_modules=ALL, std=0.08),
    "attn-r8": dict(r=8, target_modules=ATTN, std=0.05),
}
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17], [3, 3], [50, 60, 70], [5, 4, 3, 2, 1, 9]]
NAMES = ["all-r8", None, "attn-r16", "all-r16", "attn-r8", None]
PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)
SPEC = SpecConfig(num_draft_tokens=3, gate=False)


def make_engine(model, adapters, tp, **kw):
    kw.setdefault("num_kv_blocks", 256)
    engine = LLMEngine(EngineConfig(model=model, tensor_parallel_size=tp, block_size=4, max_loras=2,
                                    speculative=SPEC, **kw))
    for name, path in adapters.items():
        engine.add_adapter(name, path)
    return engine


def run(engine, spec, prompts=PROMPTS, names=NAMES):
    engine.set_speculation(spec)
    outs = engine.generate(prompt_token_ids=prompts, sampling_params=PARAMS, adapter_names=names)
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    """One torch thread here (and so in each process it starts: see conftest.one_torch_thread)."""


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    model = build_model("llama", str(root / "m"))
    adapters = {n: build_adapter(model, str(root / n), seed=i, **kw) for i, (n, kw) in enumerate(ADAPTERS.items())}
    return model, adapters


@pytest.fixture(scope="module")
def expected(models):
    """The one-rank engine's plain greedy tokens."""
    engine = make_engine(*models, tp=1)
    return run(engine, None)


@pytest.fixture(scope="module")
def tp2(models):
    engine = make_engine(*models, tp=2)
    yield engine
    engine.close()


def test_plain_steps_match_one_rank(tp2, expected):
    assert run(tp2, None) == expected
    stats = tp2.stats()
    assert stats["adapters"]["all-r16"]["loads"] >= 1 and stats["free_kv_blocks"] == stats["total_kv_blocks"]
    assert sum(a["loads"] for a in stats["adapters"].values()) > 2  # four adapters through two slots


def test_speculative_cycles_match_one_rank(tp2, expected):
    assert run(tp2, SPEC) == expected
    spec = tp2.stats()["speculative"]
    assert spec["cycles"] > 0 and spec["draft_passes"] > 0


def test_adapters_loaded_into_a_removed_adapters_slot_match(tp2, expected):
    """Removing an adapter frees its slot on both ranks (the worker's replayed); the adapters loaded there afterwards
    give one rank's tokens."""
    run(tp2, None, [PROMPTS[0]], ["all-r8"])
    assert "all-r8" in tp2.stats()["device_adapters"]
    tp2.remove_adapter("all-r8")
    assert "all-r8" not in tp2.stats()["device_adapters"]
    keep = [i for i, n in enumerate(NAMES) if n != "all-r8"]
    got = run(tp2, SPEC, [PROMPTS[i] for i in keep], [NAMES[i] for i in keep])
    assert got == [expected[i] for i in keep]


def test_identical_under_preemption(models, expected):
    engine = make_engine(*models, tp=2, num_kv_blocks=16)
    try:
        assert run(engine, SPEC) == expected
        assert engine.stats()["num_preemptions"] > 0
    finally:
        engine.close()


def test_fewer_kv_heads_than_ranks(tmp_path):
    """One KV head on two ranks (each holds a copy), q/k/v biases (qwen2), a vocabulary that does not split
    evenly (199 rows: the second rank's part padded)."""
    model = build_model("qwen2", str(tmp_path / "m"), num_key_value_heads=1)
    adapters = {"kv-r8": build_adapter(model, str(tmp_path / "kv"), seed=3, r=8, target_modules=ALL)}
    prompts, names = PROMPTS[:4], ["kv-r8", None, "kv-r8", None]
    want = run(make_engine(model, adapters, tp=1), None, prompts, names)
    engine = make_engine(model, adapters, tp=2)
    try:
        assert run(engine, None, prompts, names) == want
        assert run(engine, SPEC, prompts, names) == want
    finally:
        engine.close()


@pytest.mark.parametrize("when", ["between steps", "during a generate"])
def test_a_killed_rank_fails_the_engine_within_seconds(models, when):
    """Killed while rank 0 is idle, or (a timer) while it is stepping, likely inside a collective: either way the
    engine raises RankFailure naming the rank within seconds."""
    engine = make_engine(*models, tp=2)
    try:
        run(engine, None, PROMPTS[:1], [None])
        worker = engine.ranks.workers.procs[0]
        start = time.monotonic()
        if when == "between steps":
            os.kill(worker.pid, signal.SIGKILL)
        else:
            threading.Timer(0.3, os.kill, (worker.pid, signal.SIGKILL)).start()
        with pytest.raises(RankFailure, match=r"rank 1 \(pid \d+, exit code -9\) exited"):
            engine.generate(prompt_token_ids=PROMPTS, adapter_names=NAMES,
                            sampling_params=SamplingParams(max_tokens=200, ignore_eos=True))
        assert time.monotonic() - start < 5
        assert not engine.ranks.alive()  # what a Serve replica's health check reads (AsyncLLMEngine.is_alive)
        start = time.monotonic()
        with pytest.raises(RankFailure):  # and every step after it, at once
            engine.step()
        assert time.monotonic() - start < 1
    finally:
        engine.close()


def test_a_stuck_rank_fails_the_engine_after_the_timeout(models):
    """A rank alive but not answering (stopped) fails the engine once a collective has waited `tp_timeout_s`."""
    engine = make_engine(*models, tp=2, tp_timeout_s=1.0)  # (joining and loading are not held to it)
    worker = engine.ranks.workers.procs[0]
    try:
        run(engine, None, PROMPTS[:1], [None])
        os.kill(worker.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(RankFailure, match="every worker rank is alive but the ranks are out of step"):
            run(engine, None, PROMPTS[:2], NAMES[:2])
        assert 1.0 <= time.monotonic() - start < 8
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        engine.close()


@pytest.mark.gpu
def test_two_gpus_match_one(models):
    """The serving backend (Triton kernels, CUDA graphs capturing the NCCL collectives) on two GPUs against one."""
    from backends import CUDA_TRITON_GRAPHS

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    pytest.importorskip("triton")
    want = run(make_engine(*models, tp=1, **CUDA_TRITON_GRAPHS), None)
    engine = make_engine(*models, tp=2, **CUDA_TRITON_GRAPHS)
    try:
        assert run(engine, None) == want
        assert run(engine, SPEC) == want
    finally:
        engine.close()


def test_fp8_weights_on_two_ranks_match_one(models):
    """FP8 base weights are quantized over whole rows before a rank takes its part: a column-parallel rank holds its
    rows' scales, a row-parallel one every row's scale over its input columns, so two ranks serve one rank's model."""
    want = run(make_engine(*models, tp=1, quantization="fp8"), None)
    engine = make_engine(*models, tp=2, quantization="fp8")
    try:
        assert run(engine, None) == want
        assert run(engine, SPEC) == want
        layer = engine.runner.model.layers[0]
        assert layer.o.weight.dtype == torch.float8_e4m3fn and layer.o.scale.shape == (layer.o.weight.shape[0],)
    finally:
        engine.close()


def test_a_model_that_does_not_split_is_refused_before_any_worker_starts(models):
    model, _ = models
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not split the model: num_attention_heads 4"):
        LLMEngine(EngineConfig(model=model, tensor_parallel_size=3, num_kv_blocks=16))
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)


# ---------------------------------------------------------------- the layout, pure
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("size", [2, 4])
def test_rank_parts_reassemble_the_model(models, size, kv_heads):
    """Column-parallel weights concatenate back by output rows (each KV head once, from the first rank holding it),
    row-parallel ones by input columns, vocab rows by rank (then unpadded); norms are whole on every rank."""
    import dataclasses

    spec = dataclasses.replace(load_model_spec(models[0]), num_kv_heads=kv_heads)
    check_tensor_parallel(spec, size)
    layouts = [ShardLayout(spec, r, size) for r in range(size)]
    h, d, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    full = {"model.layers.0.self_attn.q_proj.weight": torch.randn(spec.q_size, h),
            "model.layers.0.self_attn.k_proj.bias": torch.randn(spec.kv_size),
            "model.layers.0.self_attn.o_proj.weight": torch.randn(h, spec.q_size),
            "model.layers.1.mlp.up_proj.weight": torch.randn(inter, h),
            "model.layers.1.mlp.down_proj.weight": torch.randn(h, inter),
            "model.embed_tokens.weight": torch.randn(spec.vocab_size, h),
            "model.norm.weight": torch.randn(h)}
    parts = {n: [lay.weight(n, t) for lay in layouts] for n, t in full.items()}
    cat = lambda n, dim: torch.cat(parts[n], dim)  # noqa: E731
    assert torch.equal(cat("model.layers.0.self_attn.q_proj.weight", 0), full["model.layers.0.self_attn.q_proj.weight"])
    per_head = size // kv_heads if kv_heads < size else 1  # ranks holding each KV head
    kv = torch.cat(parts["model.layers.0.self_attn.k_proj.bias"][::per_head])
    assert torch.equal(kv, full["model.layers.0.self_attn.k_proj.bias"])
    assert all(p.shape == (max(1, kv_heads // size) * d,) for p in parts["model.layers.0.self_attn.k_proj.bias"])
    assert torch.equal(cat("model.layers.0.self_attn.o_proj.weight", 1), full["model.layers.0.self_attn.o_proj.weight"])
    assert torch.equal(cat("model.layers.1.mlp.up_proj.weight", 0), full["model.layers.1.mlp.up_proj.weight"])
    assert torch.equal(cat("model.layers.1.mlp.down_proj.weight", 1), full["model.layers.1.mlp.down_proj.weight"])
    vocab = cat("model.embed_tokens.weight", 0)
    assert vocab.shape[0] == size * layouts[0].vocab_rows >= spec.vocab_size
    assert torch.equal(vocab[: spec.vocab_size], full["model.embed_tokens.weight"])
    assert not vocab[spec.vocab_size :].any()
    assert all(torch.equal(p, full["model.norm.weight"]) for p in parts["model.norm.weight"])


def test_lora_parts_follow_their_layers(models):
    """Column-parallel modules: A whole, B by output columns; row-parallel: A by input rows, B whole; so the sum of
    the ranks' row-parallel deltas, and the concatenation of their column-parallel ones, is the whole delta."""
    spec = load_model_spec(models[0])
    shapes = spec.module_shapes()
    g = torch.Generator().manual_seed(0)
    w = LoRAWeights("x", 4)
    for m in ALL:
        fan_in, fan_out = shapes[m]
        w.a[(0, m)], w.b[(0, m)], w.scale[(0, m)] = torch.randn(fan_in, 4, generator=g), torch.randn(4, fan_out), 2.0
    layouts = [ShardLayout(spec, r, 2) for r in range(2)]
    parts = [lay.lora(w) for lay in layouts]
    for m in ALL:
        x = torch.randn(3, shapes[m][0], generator=g)
        whole = x @ w.a[(0, m)] @ w.b[(0, m)]
        cols = layouts[0].columns(m)
        if cols is not None:
            got = torch.cat([x @ p.a[(0, m)] @ p.b[(0, m)] for p in parts], dim=1)
        else:
            got = sum(x[:, lay.inputs(m)] @ p.a[(0, m)] @ p.b[(0, m)] for lay, p in zip(layouts, parts))
        torch.testing.assert_close(got, whole)
