"""Stop strings, stop token ids and max_tokens end a sequence exactly where they should."""

import pytest

from char_tokenizer import add_char_tokenizer
from engine_ext import EngineConfig, LLMEngine, SamplingParams
from tiny_models import build_model

PROMPT = "the quick brown fox"


def params(**kw):
    # seeded sampling: reproducible, and varied text (greedy on a random tiny model repeats one letter)
    return SamplingParams(temperature=1.0, seed=11, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = build_model("llama", str(tmp_path_factory.mktemp("stops") / "m"), vocab_size=31)
    add_char_tokenizer(model)
    return LLMEngine(EngineConfig(model=model, num_kv_blocks=256))


@pytest.fixture(scope="module")
def free_run(engine):
    return engine.generate(prompts=[PROMPT], sampling_params=params(max_tokens=40))[0]


def test_stop_string_cuts_text_before_it(engine, free_run):
    text = free_run.text
    stop = text[10:13]
    first = text.find(stop)
    assert first > 0
    out = engine.generate(prompts=[PROMPT], sampling_params=params(max_tokens=40, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:first]
    assert out.token_ids == free_run.token_ids[: first + len(stop)]  # up to the token completing the stop


def test_stop_token_id(engine, free_run):
    stop_id = free_run.token_ids[6]
    first = free_run.token_ids.index(stop_id)
    out = engine.generate(prompts=[PROMPT], sampling_params=params(max_tokens=40, stop_token_ids=[stop_id]))[0]
    assert out.finish_reason == "stop" and out.token_ids == free_run.token_ids[: first + 1]


def test_max_tokens(engine, free_run):
    out = engine.generate(prompts=[PROMPT], sampling_params=params(max_tokens=7))[0]
    assert out.finish_reason == "length" and out.token_ids == free_run.token_ids[:7]


def test_streamed_deltas_concatenate_to_final_text(engine, free_run):
    stop = free_run.text[15:17]
    engine.add_request("s", prompt=PROMPT, sampling_params=params(max_tokens=40, stop=[stop]))
    deltas, final = [], None
    while engine.has_unfinished_requests:
        for out in engine.step():
            deltas.append(out.delta_text)
            final = out
    assert "".join(deltas) == final.text and stop not in final.text


def test_prompt_too_long_refused(engine):
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(prompt_token_ids=[1] * 300)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request(prompt_token_ids=[])
    with pytest.raises(ValueError, match="token ids must be in"):
        engine.add_request(prompt_token_ids=[10_000])
