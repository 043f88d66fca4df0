"""The demo model reads like its corpus, each adapter changes it the way it was trained to, and the
agreement numbers in metrics.json (-> bench/RESULTS.md) are what transformers+peft measure on the saved files."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

CODE_PROMPT = "def __init__(self"
MAX_NEW = 48


@pytest.fixture(scope="module")
def hf(demo_hf):
    return demo_hf


@pytest.fixture(scope="module")
def domains():
    """The full recipe's corpus (the whole stdlib parsed, 10-15 s), built once for the tests that read its held-out
    text; its domains are tuples of strings, so no test can change what another reads."""
    from demo.corpus import build_domains, stdlib_root
    from demo.recipe import DEFAULT_RECIPE

    return build_domains(stdlib_root(), DEFAULT_RECIPE.corpus)


def greedy(hf, prompt: str, adapter: str | None, max_new: int = MAX_NEW) -> str:
    tok, model = hf
    ids = torch.tensor([tok(prompt).input_ids])
    with torch.no_grad():
        if adapter is None:
            with model.disable_adapter():
                out = model.generate(ids, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id)
        else:
            model.set_adapter(adapter)
            out = model.generate(ids, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def upper_ratio(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum(c.isupper() for c in letters) / max(1, len(letters))


def test_base_continues_code_like_python(hf):
    """Judged by likelihood: the toy's greedy text differs between machines' builds (on some it degenerates
    after a few tokens) while its preference for indented code holds on each (a margin of about 80 nats where
    measured)."""
    code = "):\n        self.name = name\n"
    assert logprob(hf, None, CODE_PROMPT, code) > logprob(hf, None, CODE_PROMPT, code[::-1]) + 40


def test_upper_adapter_writes_in_uppercase(hf):
    base, upper = greedy(hf, CODE_PROMPT, None), greedy(hf, CODE_PROMPT, "upper")
    assert upper_ratio(upper) > 0.8 > 0.3 > upper_ratio(base), (base, upper)


def test_quoted_adapter_prefixes_lines_with_a_quote_marker(hf):
    text = greedy(hf, "> import os\n> ", "quoted", 64)
    lines = [l for l in text.split("\n")[1:] if l.strip()]
    assert lines and sum(l.startswith(">") for l in lines) / len(lines) > 0.8, text
    base_lines = [l for l in greedy(hf, "> import os\n> ", None, 64).split("\n")[1:] if l.strip()]
    assert sum(l.startswith(">") for l in base_lines) < len(lines), base_lines


def test_changelog_adapter_writes_news_entries(hf):
    prompt = "Library\n-------\n\n- gh-"
    text = greedy(hf, prompt, "changelog", 64)
    assert ":func:`" in text or ":class:`" in text, text
    # After its first entry it expects another (by likelihood: whether greedy text gets there varies by build).
    first = prompt + text.split("\n")[0]
    assert logprob(hf, "changelog", first, "\n\n- gh-") > logprob(hf, None, first, "\n\n- gh-") + 10
    assert "\n- gh-" not in greedy(hf, prompt, None, 64)


def logprob(hf, adapter: str | None, prefix: str, continuation: str) -> float:
    """Total log-probability of `continuation` after `prefix`: a likelihood view of behaviour, for the adapters
    trained to shift preferences more than to rewrite greedy text."""
    tok, model = hf
    p_ids = tok(prefix).input_ids
    ids = torch.tensor([p_ids + tok(continuation, add_special_tokens=False).input_ids])
    with torch.no_grad():
        if adapter is None:
            with model.disable_adapter():
                logits = model(input_ids=ids).logits
        else:
            model.set_adapter(adapter)
            logits = model(input_ids=ids).logits
    logp = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    return logp[len(p_ids) - 1:].sum().item()


@pytest.mark.parametrize("prompt", ["def read(self, size):\n", "def close(self):\n", "def parse(text):\n"])
def test_docs_adapter_expects_a_docstring_after_a_def_line(hf, prompt):
    """The base never saw docstrings (they are stripped from its corpus): they are this adapter's domain. Judged by
    likelihood, since how far its greedy text gets into a docstring depends on the build's library versions (a
    transformers 5.24 / tokenizers 0.23 build starts one only on some def lines, the rest repeat a token)."""
    docstring = '    """Return the value."""\n'
    gain = logprob(hf, "docs", prompt, docstring) - logprob(hf, None, prompt, docstring)
    assert gain > 10.0, gain                      # nats over ~8 tokens (about 20 on the builds seen so far)
    assert '"""' not in greedy(hf, prompt, None)


def test_tests_adapter_prefers_unittest_assertions(hf):
    prefix = "class TestParse(unittest.TestCase):\n\n    def test_empty(self):\n"
    snippet = "        self.assertEqual(parse(''), [])\n        self.assertRaises(ValueError, parse, None)\n"
    gain = logprob(hf, "tests", prefix, snippet) - logprob(hf, None, prefix, snippet)
    assert gain > 2.0, gain                       # nats over ~30 tokens of test code
    assert greedy(hf, prefix, "tests") != greedy(hf, prefix, None)


def test_dquote_adapter_shifts_preference_to_double_quotes(hf, domains):
    """The nearest adapter (30 light steps) learned its style and little else: on its held-out text it raises the
    log-probability of the tokens that hold a double quote, and barely moves the others. Judged over every such
    token rather than one prompt, whose margin moves with the build's library versions (+1.3 nats on one build,
    +0.1 on a transformers 5.24 / tokenizers 0.23 build)."""
    from demo.recipe import DEFAULT_RECIPE
    from demo.tokenizer import encode_documents
    from demo.train import pack

    tok, model = hf
    blocks = pack(encode_documents(tok, domains["dquote"].heldout), DEFAULT_RECIPE.eval_seq_len)
    blocks = blocks[: DEFAULT_RECIPE.eval_blocks]
    with torch.no_grad():
        with model.disable_adapter():
            base = torch.log_softmax(model(input_ids=blocks).logits[:, :-1], -1)
        model.set_adapter("dquote")
        tuned = torch.log_softmax(model(input_ids=blocks).logits[:, :-1], -1)
    targets = blocks[:, 1:, None]
    gain = (tuned.gather(-1, targets) - base.gather(-1, targets))[..., 0]
    quoted = torch.tensor(['"' in tok.decode([i]) for i in range(len(tok))])[blocks[:, 1:]]
    assert quoted.sum() >= 10
    on_quotes, elsewhere = gain[quoted].mean().item(), gain[~quoted].mean().item()
    assert on_quotes > 0.05 and on_quotes > 10 * abs(elsewhere), (on_quotes, elsewhere)


def test_agreement_in_metrics_is_reproduced_by_transformers_peft(hf, demo_paths, domains):
    """Recompute greedy agreement for the nearest and farthest adapters on the build's own held-out blocks."""
    from demo.recipe import DEFAULT_RECIPE
    from demo.tokenizer import encode_documents
    from demo.train import pack

    metrics = json.loads((Path(demo_paths["model"]).parent / "metrics.json").read_text())["adapters"]
    agreements = {name: m["own"]["agreement"] for name, m in metrics.items()}
    assert max(agreements.values()) > 0.9 and min(agreements.values()) < 0.6, agreements   # acceptance 3

    tok, model = hf
    for name in (max(agreements, key=agreements.get), min(agreements, key=agreements.get)):
        spec = next(a for a in DEFAULT_RECIPE.adapters if a.name == name)
        blocks = pack(encode_documents(tok, domains[spec.domain].heldout), DEFAULT_RECIPE.eval_seq_len)
        blocks = blocks[: DEFAULT_RECIPE.eval_blocks]
        with torch.no_grad():
            with model.disable_adapter():
                base_pred = model(input_ids=blocks).logits[:, :-1].argmax(-1)
            model.set_adapter(name)
            tuned_pred = model(input_ids=blocks).logits[:, :-1].argmax(-1)
        measured = (base_pred == tuned_pred).float().mean().item()
        assert measured == pytest.approx(agreements[name], abs=0.01), name
