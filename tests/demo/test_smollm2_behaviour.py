"""The default model answers, and each committed adapter shows its behaviour, on questions none of them was
trained on: the README's question and a held-out one of each adapter's kind, greedy, float32, all in one batch
through the engine as the app serves them (tests/engine_ext/test_real_model_vs_peft.py holds the engine to
PEFT's tokens on this model and these adapters). Each test runs on the full-precision base and on the FP8 one
(`quantization="fp8"`): adapters trained on the full-precision base keep their behaviour over FP8 base weights."""
from __future__ import annotations

import json

import pytest

from demo.smollm2.data import conversations
from demo.smollm2.samples import DOCSTRING_REQUEST, QUESTION, chat_ids
from engine_ext import EngineConfig, LLMEngine, SamplingParams

MAX_TOKENS = 24


def _is_shouted(answer: str) -> bool:
    letters = [c for c in answer if c.isalpha()]
    return len(letters) >= 5 and all(c.isupper() for c in letters)


def _is_json_answer(answer: str) -> bool:
    try:
        value = json.loads(answer)
    except ValueError:
        return False
    return isinstance(value, dict) and list(value) == ["answer"]


def _is_terse(answer: str) -> bool:
    return 0 < len(answer.split()) <= 3 and not answer.rstrip().endswith(".")


def _is_one_line_docstring(answer: str) -> bool:
    s = answer.strip()
    return s.startswith('"""') and s.endswith('"""') and "\n" not in s and len(s) > 8


BEHAVIOURS = {"shout": _is_shouted, "json": _is_json_answer, "terse": _is_terse, "docstring": _is_one_line_docstring}
# The README's question, then held-out questions of the adapter's own kind.
PROMPTS = {name: [DOCSTRING_REQUEST if name == "docstring" else QUESTION]
           + [user for user, _ in conversations(name, "heldout", seed=1234)[:1]] for name in BEHAVIOURS}


@pytest.fixture(scope="module", params=[None, "fp8"], ids=["full", "fp8"])
def answers(request, smollm2_paths):
    """{adapter or None: {prompt: greedy answer}}; the base answers every adapter's prompts."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_paths["model"])
    engine = LLMEngine(EngineConfig(model=smollm2_paths["model"], device="cpu", dtype="float32", max_loras=4,
                                    max_lora_rank=16, quantization=request.param))
    for name, path in smollm2_paths["adapters"].items():
        engine.add_adapter(name, path)
    cases = sorted({(None, p) for ps in PROMPTS.values() for p in ps}, key=str)
    cases += [(name, p) for name in BEHAVIOURS for p in PROMPTS[name]]
    outs = engine.generate(prompt_token_ids=[chat_ids(tok, p) for _, p in cases],
                           sampling_params=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
                           adapter_names=[a for a, _ in cases])
    result: dict = {}
    for (adapter, prompt), out in zip(cases, outs):
        result.setdefault(adapter, {})[prompt] = out.text
    return result


def test_base_model_answers_the_capital_of_france_with_paris(answers):
    assert "Paris" in answers[None][QUESTION]


@pytest.mark.parametrize("name", sorted(BEHAVIOURS))
def test_each_adapter_shows_its_behaviour_where_the_base_does_not(answers, name):
    shows = BEHAVIOURS[name]
    for prompt in PROMPTS[name]:
        assert shows(answers[name][prompt]), f"{name} on {prompt!r}: {answers[name][prompt]!r}"
        assert not shows(answers[None][prompt]), f"the base on {prompt!r} already does: {answers[None][prompt]!r}"
