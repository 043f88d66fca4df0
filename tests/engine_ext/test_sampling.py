"""Sampling: seeded reproducibility, Gumbel-max draws that follow the distribution, and top-k / top-p restricting
its support."""

import pytest
import torch

from engine_ext import EngineConfig, LLMEngine, SamplingParams
from engine_ext.sampler import SamplingRows, gumbel, probabilities, sample, uniforms
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
    assert SamplingRows.pack(params, [1, 2, 3, 4], logits.device) is None
    assert torch.equal(sample(logits, None, None), logits.argmax(-1))
    mixed = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 2
    rows = SamplingRows.pack(mixed, [1, 2, 3, 4], logits.device)
    got = sample(logits, rows, torch.arange(4))
    assert got[0] == logits[0].argmax() and got[2] == logits[2].argmax()


def draws(probs_row: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    """n tokens drawn from one row's logits under n different seeds at one position."""
    logits = probs_row.log()[None].expand(n, -1).contiguous()
    rows = SamplingRows.pack([params] * n, list(range(n)), logits.device)
    return sample(logits, rows, torch.full((n,), 7))


def test_noise_is_uniform_and_keyed_by_seed_and_position_alone():
    u = uniforms(torch.tensor([1, 1, 2]), torch.tensor([5, 6, 5]), 4096)
    assert 0.0 < u.min() and u.max() < 1.0
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])  # another position, another seed
    again = uniforms(torch.tensor([9, 1]), torch.tensor([0, 5]), 4096)
    assert torch.equal(again[1], u[0])  # whatever else is in the batch
    g = gumbel(torch.arange(64), torch.zeros(64, dtype=torch.long), 1000)
    assert abs(g.mean().item() - 0.5772) < 0.02  # the Euler-Mascheroni constant


def test_draws_follow_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    counts = torch.bincount(draws(probs, SamplingParams(temperature=1.0), 20000), minlength=4).float() / 20000
    assert torch.allclose(counts, probs, atol=0.015)


def test_top_k_support_and_proportions():
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.0, 0.5, 0.0]])
    p = SamplingParams(temperature=1.0, top_k=3)
    probs = probabilities(logits, [p])[0]
    assert (probs[3:] == 0).all()
    expected = torch.softmax(logits[0, :3], -1)
    assert torch.allclose(probs[:3], expected, atol=1e-6)
    got = draws(torch.softmax(logits[0], -1), p, 10000)
    counts = torch.bincount(got, minlength=6).float() / got.numel()
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
