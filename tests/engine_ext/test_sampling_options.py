"""Logit bias, penalties, min-p and logprobs: each generated token equals a reference computed from the engine's
own logits rows (return_logits), and the speculative path gives exactly plain decoding's tokens and logprobs for
every option (requests that cannot draft take their token from the verify pass)."""

import math

import pytest
import torch

from engine_ext import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from engine_ext.sampler import adjust_logits, probabilities
from tiny_models import build_adapter, build_model

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class H:
    def __init__(self, prompt, out):
        self.prompt_token_ids, self.output_token_ids = prompt, out


def test_adjust_logits_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0]])
    p = SamplingParams(logit_bias={4: 5.0}, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    got = adjust_logits(logits, [p], [H([0], [1, 1, 3])])[0]
    # bias: l4 = 5; repetition on {0, 1, 3}: 2/2, -1*2, 3/2; then frequency/presence on output {1: 2, 3: 1}
    expected = torch.tensor([1.0, -2.0 - 1.0 - 0.25, 0.5, 1.5 - 0.5 - 0.25, 5.0])
    assert torch.allclose(got, expected)
    plain = SamplingParams()
    assert adjust_logits(logits, [plain], None) is logits  # nothing to adjust: no copy, no history needed
    with pytest.raises(ValueError):
        adjust_logits(logits, [p], None)


def test_min_p_keeps_tokens_within_ratio_of_top():
    probs_in = torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]])
    kept = probabilities(probs_in.log(), [SamplingParams(temperature=1.0, min_p=0.25)])[0]
    assert (kept[2:] == 0).all() and torch.allclose(kept[:2], torch.tensor([0.625, 0.375]))
    assert torch.allclose(probabilities(probs_in.log(), [SamplingParams(temperature=1.0, min_p=0.0)])[0], probs_in)


@pytest.mark.parametrize("bad", [dict(min_p=1.5), dict(repetition_penalty=0.0), dict(presence_penalty=3.0),
                                 dict(frequency_penalty=-2.5), dict(logit_bias={1: 200.0}), dict(logprobs=21),
                                 dict(logit_bias={-1: 1.0})])
def test_invalid_options_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("opts")
    model = build_model("llama", str(root / "m"))
    adapters = {"near": build_adapter(model, str(root / "near"), seed=1, r=8, target_modules=ALL, std=0.03),
                "far": build_adapter(model, str(root / "far"), seed=2, r=16, target_modules=ALL, std=0.08)}
    return model, adapters


def make_engine(setup, spec):
    model, adapters = setup
    engine = LLMEngine(EngineConfig(model=model, max_loras=2, speculative=spec, num_kv_blocks=512, block_size=4))
    for n, p in adapters.items():
        engine.add_adapter(n, p)
    return engine


def test_logit_bias_forces_and_bans_tokens(setup):
    engine = make_engine(setup, None)
    forced = engine.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(
        max_tokens=6, temperature=1.0, logit_bias={42: 100.0}, ignore_eos=True))[0]
    assert forced.token_ids == [42] * 6
    free = engine.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=6, ignore_eos=True))
    banned = engine.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(
        max_tokens=6, ignore_eos=True, logit_bias={t: -100.0 for t in set(free[0].token_ids)}))[0]
    assert not set(banned.token_ids) & set(free[0].token_ids)


OPTIONS = {
    "bias": dict(logit_bias={3: 4.0, 17: -3.0, 100: 2.5}),
    "repetition": dict(repetition_penalty=1.8),
    "frequency": dict(frequency_penalty=1.5),
    "presence": dict(presence_penalty=1.7),
    "all": dict(logit_bias={9: 1.0}, repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=-0.4),
}


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_greedy_tokens_are_argmax_of_adjusted_engine_logits(setup, name):
    engine = make_engine(setup, None)
    prompt = [4, 8, 15, 16, 23, 42]
    p = SamplingParams(max_tokens=16, ignore_eos=True, return_logits=True, **OPTIONS[name])
    out = engine.generate(prompt_token_ids=[prompt], sampling_params=p, adapter_names=["near"])[0]
    plain = engine.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=16, ignore_eos=True),
                            adapter_names=["near"])[0]
    assert out.token_ids != plain.token_ids  # the option changed the output
    for i, row in enumerate(out.logits):  # the engine's raw row at each position, adjusted by the reference
        ref = adjust_logits(row[None], [p], [H(prompt, out.token_ids[:i])])[0]
        assert out.token_ids[i] == int(ref.argmax())


def test_logprobs_are_log_softmax_of_the_engine_logits(setup):
    engine = make_engine(setup, None)
    p = SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True, return_logits=True, logprobs=5)
    out = engine.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=p, adapter_names=["far"])[0]
    assert len(out.logprobs) == len(out.token_ids) == 8
    for tok, lp, row in zip(out.token_ids, out.logprobs, out.logits):
        ref = torch.log_softmax(row, -1)
        assert lp.token_id == tok and math.isclose(lp.logprob, float(ref[tok]), abs_tol=1e-5)
        top = ref.topk(5)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert all(math.isclose(v, w, abs_tol=1e-5) for (_, v), w in zip(lp.top, top.values.tolist()))


# One batch mixing every option, greedy and seeded-sampled, on adapters and on the base (riders). A seeded request
# draws each token with noise keyed by its seed and position, and a draft is kept only where it equals the target's
# draw, so its samples equal plain decoding's token for token, drafted (top-p and min-p on "near") or not.
MIXED = [
    ([1, 2, 3, 4, 5], "near", dict()),
    ([7, 8, 9], "near", dict(logit_bias={11: 3.0})),
    ([10, 11, 12, 13], "far", dict(repetition_penalty=1.5, logprobs=3)),
    ([3, 3], None, dict(frequency_penalty=1.2, presence_penalty=0.3)),
    ([50, 60, 70], "far", dict(temperature=0.9, seed=11, presence_penalty=1.0, top_k=20)),
    ([5, 4, 3], None, dict(temperature=1.1, seed=12, logprobs=2, min_p=0.05)),
    ([9, 9, 1], "near", dict(temperature=0.8, seed=13, min_p=0.1, top_p=0.9)),
    ([2, 7], None, dict()),
    ([6, 1, 6], "near", dict(logprobs=0)),
]


def run_mixed(setup, spec):
    engine = make_engine(setup, spec)
    params = [SamplingParams(max_tokens=20, ignore_eos=True, **kw) for _, _, kw in MIXED]
    outs = engine.generate(prompt_token_ids=[m[0] for m in MIXED], sampling_params=params,
                           adapter_names=[m[1] for m in MIXED])
    return outs, engine.stats()


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_equals_plain_for_every_option(setup, k):
    plain, _ = run_mixed(setup, None)
    spec, stats = run_mixed(setup, SpecConfig(num_draft_tokens=k, gate=False))
    assert stats["speculative"]["cycles"] > 0 and stats["adapters"]["near"]["accepted_tokens"] > 0
    for (prompt, adapter, kw), a, b in zip(MIXED, plain, spec):
        p = SamplingParams(**kw)
        if adapter is not None and p.can_draft and not p.greedy and p.seed is None:
            continue  # an unseeded sampled drafter: equal in distribution (the chi-square tests), not sample by sample
        assert a.token_ids == b.token_ids, kw
        if kw.get("logprobs") is not None:
            assert [x.token_id for x in a.logprobs] == [x.token_id for x in b.logprobs]
            assert all(math.isclose(x.logprob, y.logprob, abs_tol=1e-4) for x, y in zip(a.logprobs, b.logprobs))
            assert [[t for t, _ in x.top] for x in a.logprobs] == [[t for t, _ in y.top] for y in b.logprobs]
        else:
            assert a.logprobs is None and b.logprobs is None
    assert stats["free_kv_blocks"] == stats["total_kv_blocks"]
