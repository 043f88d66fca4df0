"""Speculative sampling is lossless: a two-sample chi-square test cannot tell it from plain sampling,
and it does tell them apart when the acceptance rule is deliberately broken (the test has power)."""

import collections

import numpy as np
import pytest
from scipy.stats import chi2_contingency

import engine_ext.speculative as speculative
from engine_ext import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from tiny_models import build_adapter, build_model

N = 20_000
PROMPT = [1, 2, 3, 4]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("chi")
    model = build_model("llama", str(root / "m"), vocab_size=6, seed=2)
    # Moderately far from the base: many drafts rejected, so a wrong rule would show.
    adapter = build_adapter(model, str(root / "a"), seed=9, r=16, std=0.25,
                            target_modules=("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"))
    return model, adapter


def first_tokens(paths, spec, params, seed):
    engine = LLMEngine(EngineConfig(model=paths[0], speculative=spec, seed=seed, num_kv_blocks=4096, block_size=4,
                                    max_loras=1, max_lora_rank=16,
                                    max_num_seqs=2048, max_num_batched_tokens=16384))
    engine.add_adapter("a", paths[1])
    outs = engine.generate(prompt_token_ids=[PROMPT] * N, sampling_params=params, adapter_names=["a"] * N)
    return collections.Counter(tuple(o.token_ids[:2]) for o in outs), engine.stats()


def p_value(a: collections.Counter, b: collections.Counter) -> float:
    cells = sorted(set(a) | set(b))
    table = np.array([[a[c] for c in cells], [b[c] for c in cells]], dtype=float)
    expected = table.sum(0) * table.sum(1)[:, None] / table.sum()
    rare = expected.min(0) < 5  # pool sparse cells so the chi-square approximation holds
    if rare.any():
        table = np.concatenate([table[:, ~rare], table[:, rare].sum(1, keepdims=True)], axis=1)
    return chi2_contingency(table)[1]


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True),
    SamplingParams(max_tokens=3, temperature=0.7, top_k=4, top_p=0.9, ignore_eos=True),
], ids=["t1", "t0.7-topk4-topp0.9"])
def test_speculative_sampling_matches_plain(paths, params, monkeypatch):
    # max_tokens=3: the first token comes from the prefill, the second from a speculative cycle
    # (one draft, accepted or resampled from the residual, then the target's own token).
    plain, _ = first_tokens(paths, None, params, seed=1)
    spec, stats = first_tokens(paths, SpecConfig(num_draft_tokens=1, gate=False), params, seed=2)
    acceptance = stats["adapters"]["a"]["acceptance_rate"]
    assert stats["adapters"]["a"]["drafted_tokens"] >= N * 0.99 and 0.2 < acceptance < 0.95
    assert p_value(plain, spec) > 0.01

    monkeypatch.setattr(speculative, "acceptance_probability", lambda p, q: p.new_tensor(1.0))  # accept every draft
    broken, _ = first_tokens(paths, SpecConfig(num_draft_tokens=1, gate=False), params, seed=3)
    assert p_value(plain, broken) < 0.01
