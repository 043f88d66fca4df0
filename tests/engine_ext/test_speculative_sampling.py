"""Speculative sampling is lossless: the first three generated tokens of 20,000 speculative samples fit the
exact distribution of plain multi-LoRA sampling (chi-square goodness of fit, p > 0.01), and the same test
rejects a deliberately broken acceptance rule (it has power: a draft accepted wrongly leaves the token after it
drawn in the wrong context).

The plain distribution is computed exactly rather than sampled: P(t1, t2, t3) = p(t1 | prompt) p(t2 | prompt, t1)
p(t3 | prompt, t1, t2)
with p the plain engine's adapter-on next-token distribution after temperature, top-k and top-p. The vocabulary
is 6 tokens, so that is 6 + 1 forward passes."""

import collections

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import engine_ext.speculation.verify as speculative
from engine_ext import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from engine_ext.sampler import probabilities
from tiny_models import build_adapter, build_model

PROMPT = [1]
PARAMS = SamplingParams(max_tokens=3, temperature=0.8, top_k=5, top_p=0.95, ignore_eos=True)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("chi")
    model = build_model("llama", str(root / "m"), vocab_size=6, seed=2)
    # Moderately far from the base: many drafts rejected, so a wrong rule would show.
    adapter = build_adapter(model, str(root / "a"), seed=9, r=16, std=0.25,
                            target_modules=("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"))
    return model, adapter


def engine_for(paths, spec, seed=0):
    engine = LLMEngine(EngineConfig(model=paths[0], speculative=spec, seed=seed, num_kv_blocks=8192, block_size=4,
                                    max_loras=1, max_lora_rank=16, max_num_seqs=4096, max_num_batched_tokens=16384))
    engine.add_adapter("a", paths[1])
    return engine


def exact_plain(paths, prompt=PROMPT, depth: int = 3) -> dict[tuple[int, ...], float]:
    """P(the first `depth` tokens) under plain decoding, for every sequence of them (6 ** depth)."""
    engine = engine_for(paths, None)
    greedy = SamplingParams(max_tokens=1, ignore_eos=True, return_logits=True)

    def next_probs(prefix):
        logits = engine.generate(prompt_token_ids=[prefix], sampling_params=greedy, adapter_names=["a"])[0].logits
        return probabilities(logits, [PARAMS])[0].double()

    table = {(): 1.0}
    for _ in range(depth):
        table = {seq + (t,): p * float(q) for seq, p in table.items() if p > 0
                 for t, q in enumerate(next_probs(prompt + list(seq)))}
    return table


def sample_pairs(paths, n, seed, depth: int = 3):
    engine = engine_for(paths, SpecConfig(num_draft_tokens=1, gate=False), seed)
    outs = engine.generate(prompt_token_ids=[PROMPT] * n, sampling_params=PARAMS, adapter_names=["a"] * n)
    return collections.Counter(tuple(o.token_ids[:depth]) for o in outs), engine.stats()


def p_value(observed: collections.Counter, exact: dict) -> float:
    if any(exact.get(c, 0.0) == 0.0 for c in observed):
        return 0.0  # a pair plain sampling can never produce (e.g. outside its top-k): certainly different
    cells = [c for c in exact if exact[c] > 0]
    n = sum(observed.values())
    obs = np.array([observed[c] for c in cells], dtype=float)
    exp = np.array([exact[c] for c in cells]) * n
    rare = exp < 5  # pool sparse cells so the chi-square approximation holds
    if rare.any():
        obs = np.append(obs[~rare], obs[rare].sum())
        exp = np.append(exp[~rare], exp[rare].sum())
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def test_speculative_sampling_matches_plain_distribution(paths, monkeypatch):
    exact = exact_plain(paths)
    assert sum(exact.values()) == pytest.approx(1.0)
    # max_tokens=3: t1 comes from the prefill; t2 and t3 from a speculative cycle (one LoRA-off draft, accepted when
    # it is the target's own draw at its position, t2, and the target's token after it, t3).
    observed, stats = sample_pairs(paths, 20_000, seed=1)
    ad = stats["adapters"]["a"]
    assert ad["drafted_tokens"] >= 19_000 and 0.2 < ad["acceptance_rate"] < 0.95
    assert p_value(observed, exact) > 0.01

    monkeypatch.setattr(speculative, "accepted_lengths", lambda d, t, valid: valid.long().sum(1))  # accept all
    broken, _ = sample_pairs(paths, 5_000, seed=2)
    assert p_value(broken, exact) < 0.01


def sample_pairs_of_prompts_in_cycles(paths, n, seed):
    """n sampled requests admitted while another one decodes: each has its prompt (two tokens: a one-token prompt
    is a decoding step already, which drafts from the start) computed in a cycle's first drafting pass (adapter on,
    t1 drawn there), then drafts one token in the second (adapters off), which the verify pass accepts or not (t2,
    and t3 after it)."""
    engine = engine_for(paths, SpecConfig(num_draft_tokens=2, gate=False), seed)
    engine.add_request("pilot", prompt_token_ids=PROMPT, adapter_name="a",
                       sampling_params=SamplingParams(max_tokens=200, ignore_eos=True))
    engine.step()  # its prompt: a plain step; from now on every step is a cycle
    ids = [engine.add_request(prompt_token_ids=PROMPT2, sampling_params=PARAMS, adapter_name="a") for _ in range(n)]
    final = {}
    while len(final) < n:
        final |= {o.request_id: o.token_ids for o in engine.step() if o.finished and o.request_id != "pilot"}
    return collections.Counter(tuple(final[i][:3]) for i in ids), engine.stats()


PROMPT2 = [1, 2]


def test_prompts_computed_in_a_drafting_pass_keep_the_plain_distribution(paths, monkeypatch):
    exact = exact_plain(paths, PROMPT2)
    observed, stats = sample_pairs_of_prompts_in_cycles(paths, 20_000, seed=3)
    spec = stats["speculative"]
    assert spec["ridden_prompts"] == 20_000
    assert stats["adapters"]["a"]["drafted_tokens"] >= 20_000  # each one's draft in the second pass
    assert p_value(observed, exact) > 0.01

    monkeypatch.setattr(speculative, "accepted_lengths", lambda d, t, valid: valid.long().sum(1))  # accept all
    broken, _ = sample_pairs_of_prompts_in_cycles(paths, 5_000, seed=4)
    assert p_value(broken, exact) < 0.01
