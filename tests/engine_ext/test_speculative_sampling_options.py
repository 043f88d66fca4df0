"""The chi-square losslessness test of test_speculative_sampling, for the options that change the target
distribution: min-p (drafting stays on: draft and target distributions both apply it) and penalties (drafting
off for the request: its token comes from the verify pass)."""

import pytest

import test_speculative_sampling as chi
from engine_ext import SamplingParams


@pytest.mark.parametrize("extra,drafts", [(dict(min_p=0.12), True),
                                          (dict(presence_penalty=1.5, logit_bias={2: 1.0}), False)])
def test_speculative_sampling_matches_plain_with_option(paths, monkeypatch, extra, drafts):
    params = SamplingParams(max_tokens=3, temperature=0.8, top_k=5, top_p=0.95, ignore_eos=True, **extra)
    monkeypatch.setattr(chi, "PARAMS", params)
    if drafts:
        exact = chi.exact_plain(paths, depth=3)
    else:  # t2's distribution depends on t1 through the penalty: p2 from the logits after the adjusted prefix
        exact = exact_with_adjustments(paths, params)
    assert sum(exact.values()) == pytest.approx(1.0)
    observed, stats = chi.sample_pairs(paths, 8_000, seed=5, depth=3 if drafts else 2)
    ad = stats["adapters"]["a"]
    assert (ad["drafted_tokens"] > 7_000) if drafts else (ad["drafted_tokens"] == 0)
    assert chi.p_value(observed, exact) > 0.01


def exact_with_adjustments(paths, params):
    from engine_ext.sampler import adjust_logits

    engine = chi.engine_for(paths, None)
    greedy = SamplingParams(max_tokens=1, ignore_eos=True, return_logits=True)

    class H:
        def __init__(self, out):
            self.prompt_token_ids, self.output_token_ids = chi.PROMPT, out

    def next_probs(out):
        logits = engine.generate(prompt_token_ids=[chi.PROMPT + out], sampling_params=greedy,
                                 adapter_names=["a"])[0].logits
        return chi.probabilities(adjust_logits(logits, [params], [H(out)]), [params])[0].double()

    first = next_probs([])
    return {(a, b): float(first[a] * p2) for a in range(6) for b, p2 in enumerate(next_probs([a]))}


paths = chi.paths
