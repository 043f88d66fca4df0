"""The engine against transformers + PEFT on a real model: SmolLM2-135M-Instruct (30 layers, GQA 9/3, tied
embeddings, a 49k vocabulary) and its four adapters (ranks 4-16; attention, MLP-only, q/v-only and all seven
projections), float32, chat prompts, every adapter and the base mixed in one batch; plain decoding and forced
speculation (k = 4) must both give PEFT's greedy tokens."""
from __future__ import annotations

import pytest
import torch

from demo.smollm2.samples import DOCSTRING_REQUEST, QUESTION, chat_ids
from engine_ext import EngineConfig, LLMEngine, SamplingParams, SpecConfig

PROMPTS = (QUESTION, DOCSTRING_REQUEST, "Which month comes after March?")
MAX_TOKENS = 12


def _strip_eos(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos)] if eos in ids else ids


@pytest.fixture(scope="module")
def cases_and_peft_tokens(smollm2_paths, smollm2_hf):
    tok, model = smollm2_hf
    cases = [(p, a) for a in [None, *smollm2_paths["adapters"]] for p in PROMPTS]
    expected = []
    with torch.no_grad():
        for prompt, adapter in cases:
            ids = torch.tensor([chat_ids(tok, prompt)])
            gen = dict(attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                       pad_token_id=tok.pad_token_id)
            if adapter is None:
                with model.disable_adapter():
                    out = model.generate(ids, **gen)
            else:
                model.set_adapter(adapter)
                out = model.generate(ids, **gen)
            expected.append(_strip_eos(out[0, ids.shape[1]:].tolist(), tok.eos_token_id))
    return cases, expected


@pytest.mark.parametrize("speculative", [None, SpecConfig(num_draft_tokens=4, gate=False, min_acceptance=0.0)],
                         ids=["plain", "forced-speculation"])
def test_engine_greedy_equals_peft_on_smollm2(smollm2_paths, smollm2_hf, cases_and_peft_tokens, speculative):
    tok, _ = smollm2_hf
    cases, expected = cases_and_peft_tokens
    engine = LLMEngine(EngineConfig(model=smollm2_paths["model"], device="cpu", dtype="float32", max_loras=4,
                                    max_lora_rank=16, speculative=speculative))
    for name, path in smollm2_paths["adapters"].items():
        engine.add_adapter(name, path)
    outs = engine.generate(prompt_token_ids=[chat_ids(tok, p) for p, _ in cases],
                           sampling_params=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
                           adapter_names=[a for _, a in cases])
    for (prompt, adapter), want, out in zip(cases, expected, outs):
        have = _strip_eos(list(out.token_ids), tok.eos_token_id)
        assert have == want, (f"adapter={adapter} prompt={prompt!r}: engine {tok.decode(have)!r} "
                              f"!= peft {tok.decode(want)!r}")
    if speculative is not None:
        adapters = engine.stats()["adapters"]
        assert all(adapters[name]["verifies"] > 0 for name in smollm2_paths["adapters"]), adapters
    # Only meaningful if each adapter changes the greedy tokens of some prompt.
    by_adapter = {a: [e for (_, b), e in zip(cases, expected) if b == a] for a in [None, *smollm2_paths["adapters"]]}
    assert all(by_adapter[a] != by_adapter[None] for a in smollm2_paths["adapters"])
