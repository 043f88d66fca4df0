"""The default model answers, and each committed adapter shows its behaviour, on questions none of them was
trained on (greedy, transformers + peft, float32): the README's question and held-out ones of each kind."""
from __future__ import annotations

import json

import pytest

from demo.smollm2.data import conversations
from demo.smollm2.samples import DOCSTRING_REQUEST, QUESTION, greedy_answer

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
           + [user for user, _ in conversations(name, "heldout", seed=1234)[:2]] for name in BEHAVIOURS}


@pytest.fixture(scope="module")
def answers(smollm2_hf):
    tok, model = smollm2_hf
    out = {}
    with model.disable_adapter():
        out[None] = {p: greedy_answer(model, tok, p, MAX_TOKENS) for name in BEHAVIOURS for p in PROMPTS[name]}
    for name in BEHAVIOURS:
        model.set_adapter(name)
        out[name] = {p: greedy_answer(model, tok, p, MAX_TOKENS) for p in PROMPTS[name]}
    return out


def test_base_model_answers_the_capital_of_france_with_paris(answers):
    assert "Paris" in answers[None][QUESTION]


@pytest.mark.parametrize("name", sorted(BEHAVIOURS))
def test_each_adapter_shows_its_behaviour_where_the_base_does_not(answers, name):
    shows = BEHAVIOURS[name]
    for prompt in PROMPTS[name]:
        assert shows(answers[name][prompt]), f"{name} on {prompt!r}: {answers[name][prompt]!r}"
        assert not shows(answers[None][prompt]), f"the base on {prompt!r} already does: {answers[None][prompt]!r}"
