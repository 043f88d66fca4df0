"""Sampling: seeded reproducibility, and top-k / top-p restricting the support of the distribution."""

import pytest
import torch

from engine_ext import EngineConfig, LLMEngine, SamplingParams
from engine_ext.sampler import draw, probabilities, sample
from tiny_models import build_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = build_model("llama", str(tmp_path_factory.mktemp("s") / "m"))
    return LLMEngine(EngineConfig(model=model, num_kv_blocks=256, seed=123))


def test_fixed_seed_reproducible_whatever_the_batch(engine):
    p = SamplingParams(max_tokens=20, temperature=1.0, seed=7, ignore_eos=True)
    alone = engine.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=p)[0].token_ids
    other = SamplingParams(max_tokens=20, temperature=1.3, ignore_eos=True)
    mixed = engine.generate(prompt_token_ids=[[4, 5], [1, 2, 3], [6]], sampling_params=[other, p, other])
    assert mixed[1].token_ids == alone
    different_seed = SamplingParams(max_tokens=20, temperature=1.0, seed=8, ignore_eos=True)
    assert engine.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=different_seed)[0].token_ids != alone


def test_unseeded_sampling_varies(engine):
    p = SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)
    runs = {tuple(engine.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=p)[0].token_ids) for _ in range(3)}
    assert len(runs) > 1


def test_greedy_is_argmax():
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=0.0)] * 4
    assert torch.equal(sample(logits, params, [None] * 4, torch.Generator()), logits.argmax(-1))


def test_top_k_support_and_proportions():
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.0, 0.5, 0.0]])
    p = SamplingParams(temperature=1.0, top_k=3)
    probs = probabilities(logits, [p])[0]
    assert (probs[3:] == 0).all()
    expected = torch.softmax(logits[0, :3], -1)
    assert torch.allclose(probs[:3], expected, atol=1e-6)
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([draw(probs[None].expand(2000, -1).contiguous(), [None] * 2000, g) for _ in range(5)]).flatten()
    counts = torch.bincount(draws, minlength=6).float() / draws.numel()
    assert counts[3:].sum() == 0
    assert torch.allclose(counts[:3], expected, atol=0.02)


def test_top_p_keeps_smallest_nucleus():
    probs_in = torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]])
    logits = probs_in.log()
    kept = probabilities(logits, [SamplingParams(temperature=1.0, top_p=0.75)])[0]
    assert (kept[2:] == 0).all() and torch.allclose(kept[:2], torch.tensor([0.625, 0.375]))
    kept = probabilities(logits, [SamplingParams(temperature=1.0, top_p=0.85)])[0]
    assert (kept[3:] == 0).all() and kept[2] > 0
    one = probabilities(logits, [SamplingParams(temperature=1.0, top_p=0.1)])[0]
    assert one[0] == 1.0


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 0.0]])
    hot = probabilities(logits, [SamplingParams(temperature=2.0)])[0]
    cold = probabilities(logits, [SamplingParams(temperature=0.5)])[0]
    assert cold[0] > torch.softmax(logits[0], -1)[0] > hot[0]


def test_sampled_tokens_respect_top_k_in_engine(engine):
    """Through the engine: with top_k=1 sampling at any temperature equals greedy."""
    greedy = engine.generate(prompt_token_ids=[[9, 9, 9]], sampling_params=SamplingParams(max_tokens=12, ignore_eos=True))
    topk1 = engine.generate(prompt_token_ids=[[9, 9, 9]],
                            sampling_params=SamplingParams(max_tokens=12, temperature=5.0, top_k=1, ignore_eos=True))
    assert greedy[0].token_ids == topk1[0].token_ids


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0.0), dict(top_k=0),
                                 dict(stop=[""])])
def test_invalid_params_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
