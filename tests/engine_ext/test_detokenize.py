"""Incremental detokenization (output_processor.py): the text streamed token by token equals the tokenizer's
decode of the whole output, for the real models' tokenizers, over special tokens, multi-byte characters cut
between tokens, and stop strings that span tokens."""

import random

import pytest

from engine_ext.detokenizer import stream_backend
from engine_ext.output_processor import OutputProcessor
from engine_ext.sampling_params import SamplingParams
from engine_ext.sequence import Sequence

TEXTS = ["Hello, world! Ünïcödé façade — 日本語のテキスト 🙂🚀 done.", "def f(x):\n    return x ** 2  # squares\n",
         "  leading spaces,\ttabs and\r\nnewlines  "]


@pytest.fixture(scope="module", params=["smollm2", "demo"])
def tokenizer(request):
    from transformers import AutoTokenizer

    paths = request.getfixturevalue(f"{request.param}_paths")
    return AutoTokenizer.from_pretrained(paths["model"])


def stream(tokenizer, ids, **params):
    """(concatenated deltas, final output) of feeding `ids` one token per step."""
    proc = OutputProcessor(tokenizer, set(), max_model_len=1 << 20)
    seq = Sequence("r", [1], SamplingParams(max_tokens=len(ids) + 1, ignore_eos=True, **params))
    deltas = []
    for token in ids:
        done = proc.append(seq, token)
        out = proc.output(seq, done)
        deltas.append(out.delta_text)
        if done:
            return "".join(deltas), out
    out = proc.output(seq, True)
    return "".join(deltas) + out.delta_text, out


def test_the_real_tokenizers_stream(tokenizer):
    assert stream_backend(tokenizer) is not None  # the incremental path is the one under test


def test_streamed_text_is_the_whole_decode(tokenizer):
    rng = random.Random(0)
    specials = list(tokenizer.all_special_ids)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        for _ in range(3):  # with special tokens sprinkled in, which skip_special_tokens drops
            mixed = list(ids)
            for _ in range(3):
                mixed.insert(rng.randrange(len(mixed) + 1), rng.choice(specials))
            joined, out = stream(tokenizer, mixed)
            assert joined == out.text == tokenizer.decode(mixed, skip_special_tokens=True)
            assert out.token_ids == mixed


def test_random_ids_stream_like_the_whole_decode(tokenizer):
    """Arbitrary ids: byte tokens that form no character, partial UTF-8 at the end."""
    rng = random.Random(1)
    for _ in range(5):
        ids = [rng.randrange(len(tokenizer)) for _ in range(40)]
        joined, out = stream(tokenizer, ids)
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        assert joined == out.text
        assert whole.startswith(out.text) and len(whole) - len(out.text) <= 3  # at most a held-back character


def test_stop_string_spanning_tokens(tokenizer):
    text = "alpha beta gamma delta epsilon"
    ids = tokenizer.encode(text, add_special_tokens=False)
    joined, out = stream(tokenizer, ids, stop=["ma del"])
    assert out.finish_reason == "stop"
    assert out.text == joined == "alpha beta gam"
