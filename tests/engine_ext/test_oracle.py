"""The engine against transformers + PEFT: greedy tokens identical and next-token logits within 1e-4,
for mixed batches of base-only and many-adapter requests, across architectures and cache layouts."""

import pytest
import torch

from engine_ext import EngineConfig, LLMEngine, SamplingParams
from tiny_models import build_adapter, build_model, hf_oracle

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTERS = {  # name -> build kwargs: ranks 4..64, rslora, partial targets, a rank/alpha pattern, a regex target
    "r4-attn": dict(r=4, alpha=8, target_modules=("q_proj", "v_proj")),
    "r8-all": dict(r=8, alpha=16, target_modules=ALL),
    "r16-rslora": dict(r=16, alpha=32, target_modules=("q_proj", "k_proj", "o_proj", "down_proj"), use_rslora=True),
    "r64-mlp": dict(r=64, alpha=32, target_modules=("gate_proj", "up_proj", "down_proj"), std=0.05),
    "pattern": dict(r=8, alpha=8, target_modules=ALL, rank_pattern={"o_proj": 4, "layers.1.mlp.down_proj": 12},
                    alpha_pattern={"q_proj": 24}),
    "regex": dict(r=8, alpha=16, target_modules=r".*\.layers\.1\..*(v_proj|up_proj)"),
}
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [3, 3], [50, 60, 70, 80],
           [5, 4, 3, 2, 1, 9], [100, 101], [42] * 13]
NAMES = [None, "r4-attn", "r8-all", None, "r16-rslora", "r64-mlp", "pattern", "regex"]
NEW_TOKENS = 32


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def setup(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    model = build_model(request.param, str(root / "model"))
    adapters = {n: build_adapter(model, str(root / n), seed=i, **kw) for i, (n, kw) in enumerate(ADAPTERS.items())}
    oracle = hf_oracle(model, adapters)
    expected = [oracle(p, a, NEW_TOKENS) for p, a in zip(PROMPTS, NAMES)]
    return model, adapters, expected


def make_engine(model, adapters, **kw):
    engine = LLMEngine(EngineConfig(model=model, max_loras=len(adapters), **kw))
    for name, path in adapters.items():
        engine.add_adapter(name, path)
    return engine


PARAMS = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, return_logits=True)


def check(outs, expected, indices=None):
    for i, out in zip(indices or range(len(outs)), outs):
        tokens, logits = expected[i]
        assert out.token_ids == tokens, f"request {i} ({NAMES[i]}): tokens differ"
        diff = (out.logits - logits).abs().max().item()
        assert diff < 1e-4, f"request {i} ({NAMES[i]}): logits differ by {diff}"


@pytest.mark.parametrize("block_size", [1, 16])
def test_mixed_batch_matches_peft(setup, block_size):
    model, adapters, expected = setup
    engine = make_engine(model, adapters, block_size=block_size, num_kv_blocks=4096 // block_size)
    check(engine.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS, adapter_names=NAMES), expected)
    assert engine.stats()["num_preemptions"] == 0


def test_same_outputs_under_forced_preemption(setup):
    model, adapters, expected = setup
    # 14 blocks of 4 tokens cannot hold 8 sequences of up to 43 tokens: the scheduler must preempt and recompute.
    engine = make_engine(model, adapters, block_size=4, num_kv_blocks=14)
    check(engine.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS, adapter_names=NAMES), expected)
    assert engine.stats()["num_preemptions"] > 0
    assert engine.stats()["free_kv_blocks"] == 14


def test_requests_joining_mid_generation(setup):
    model, adapters, expected = setup
    engine = make_engine(model, adapters, block_size=16, num_kv_blocks=64)
    done = {}
    pending = list(range(len(PROMPTS)))
    step = 0
    while pending or engine.has_unfinished_requests:
        if pending and step % 5 == 0:  # a new request every 5 steps, while others are mid-generation
            i = pending.pop(0)
            engine.add_request(str(i), prompt_token_ids=PROMPTS[i], sampling_params=PARAMS, adapter_name=NAMES[i])
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out
        step += 1
    check([done[i] for i in range(len(PROMPTS))], expected)


def test_adapters_evicted_and_reloaded_through_few_slots(setup):
    model, adapters, expected = setup
    engine = LLMEngine(EngineConfig(model=model, max_loras=2, max_cpu_loras=2, block_size=8, num_kv_blocks=128))
    for name, path in adapters.items():
        engine.add_adapter(name, path)
    check(engine.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS, adapter_names=NAMES), expected)
    stats = engine.stats()["adapters"]
    assert sum(s["disk_loads"] for s in stats.values()) > 0  # host cache of 2 forced re-reads
    assert len(engine.stats()["device_adapters"]) <= 2
