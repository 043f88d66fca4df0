"""Acceptance 1 of the demo: our engine and transformers+peft give the same greedy tokens on the demo set."""
from __future__ import annotations

import torch

from engine_ext import EngineConfig, LLMEngine, SamplingParams

PROMPTS = ["def __init__(self", "import os\n\n", "class Parser:\n    def parse(self"]
MAX_TOKENS = 24


def _hf_greedy(model, tok, prompt_ids: list[int]) -> list[int]:
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                         pad_token_id=tok.pad_token_id)
    return _strip_eos(out[0, len(prompt_ids):].tolist(), tok.eos_token_id)


def _strip_eos(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos)] if eos in ids else ids


def test_engine_matches_transformers_peft_greedy_for_base_and_every_adapter(demo_paths, demo_hf):
    tok, peft_model = demo_hf
    names = list(demo_paths["adapters"])

    cases = [(p, a) for a in [None, *names] for p in PROMPTS]      # every adapter and the base, mixed in one batch
    expected = []
    with torch.no_grad():
        for prompt, adapter in cases:
            ids = tok(prompt).input_ids
            if adapter is None:
                with peft_model.disable_adapter():
                    expected.append(_hf_greedy(peft_model, tok, ids))
            else:
                peft_model.set_adapter(adapter)
                expected.append(_hf_greedy(peft_model, tok, ids))

    engine = LLMEngine(EngineConfig(model=demo_paths["model"], device="cpu", dtype="float32",
                                    max_loras=8, max_lora_rank=64))
    for name, path in demo_paths["adapters"].items():
        engine.add_adapter(name, path)
    outs = engine.generate(prompt_token_ids=[tok(p).input_ids for p, _ in cases],
                           sampling_params=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
                           adapter_names=[a for _, a in cases])
    got = [_strip_eos(list(o.token_ids), tok.eos_token_id) for o in outs]
    for (prompt, adapter), want, have in zip(cases, expected, got):
        assert have == want, f"adapter={adapter} prompt={prompt!r}: engine {have} != hf {want}"
    # The comparison is only meaningful if the adapters actually change the greedy tokens.
    assert len({tuple(e) for e in expected[len(PROMPTS):]}) > len(PROMPTS)
