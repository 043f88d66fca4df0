"""Every OpenAI parameter is honoured as specified, checked with the official `openai` client against the real
data plane (registry, replica logic, engine; no Ray) and a reference computed from the engine's own logits:
an independent `LLMEngine` on the same files returns each position's raw logits and the test applies the
documented formulas itself."""

import asyncio
import math

import pytest
import torch

from tests.deployments import data_plane_kit as K


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    kit = K.build(tmp_path_factory.mktemp("params"))
    yield kit
    K.close(kit)


@pytest.fixture(scope="module")
def ref(kit):
    """next_logits(adapter, ids) -> the raw adapter-on logits after `ids`, from a separate plain engine."""
    from deployments.engine_settings import engine_config
    from engine_ext import LLMEngine, SamplingParams

    engine = LLMEngine(engine_config(kit.cfg, kit.engine.config.model))
    for name, path in kit.demo.items():
        engine.add_adapter(name, path)
    probe = SamplingParams(max_tokens=1, return_logits=True, ignore_eos=True)

    def next_logits(adapter, ids):
        return engine.generate(prompt_token_ids=[ids], sampling_params=probe, adapter_names=[adapter])[0].logits[0]

    return next_logits


def adjusted_greedy(ref, adapter, prompt, steps, bias=None, rep=1.0, freq=0.0, pres=0.0):
    """The documented order: bias, repetition (prompt + output), frequency and presence (output); argmax."""
    out = []
    for _ in range(steps):
        lg = ref(adapter, prompt + out).clone()
        for t, b in (bias or {}).items():
            lg[t] += b
        for t in set(prompt + out):
            lg[t] = lg[t] / rep if lg[t] > 0 else lg[t] * rep
        for t in set(out):
            lg[t] -= freq * out.count(t) + pres
        out.append(int(lg.argmax()))
    return out


def ids_of(kit, text):
    return kit.engine.tokenizer(text)["input_ids"]


PROMPT = "def main():\n    "


@pytest.mark.parametrize("opts", [
    dict(frequency_penalty=1.8),
    dict(presence_penalty=1.9),
    dict(extra_body={"repetition_penalty": 2.5}),
    dict(logit_bias={"200": 6.0, "301": -100.0}),
])
def test_penalties_and_logit_bias_match_the_reference(kit, ref, opts):
    c = kit.client()
    prompt = ids_of(kit, PROMPT)
    kw = dict(model=kit.adapter, prompt=PROMPT, max_tokens=10, temperature=0)
    r = kit.run(c.completions.create(**kw, **opts))
    plain = kit.run(c.completions.create(**kw))
    extra = opts.get("extra_body", {})
    expected = adjusted_greedy(ref, kit.adapter, prompt, r.usage.completion_tokens,
                               bias={int(k): v for k, v in opts.get("logit_bias", {}).items()},
                               rep=extra.get("repetition_penalty", 1.0), freq=opts.get("frequency_penalty", 0.0),
                               pres=opts.get("presence_penalty", 0.0))
    assert r.choices[0].text == kit.engine.tokenizer.decode(expected, skip_special_tokens=True)
    assert r.choices[0].text != plain.choices[0].text  # the option did something


def test_completion_logprobs_are_the_engine_log_softmax(kit, ref):
    c = kit.client()
    r = kit.run(c.completions.create(model=kit.adapter, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3))
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    ids = ids_of(kit, PROMPT)
    out = []
    tok = kit.engine.tokenizer
    for i, (text, value, top) in enumerate(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)):
        row = torch.log_softmax(ref(kit.adapter, ids + out), -1)
        best = int(row.argmax())
        assert text == tok.decode([best]) and math.isclose(value, float(row[best]), abs_tol=1e-4)
        want = row.topk(3)
        assert len(top) <= 3 and all(math.isclose(top[tok.decode([t])], float(v), abs_tol=1e-4)
                                     for t, v in zip(want.indices.tolist(), want.values.tolist())
                                     if tok.decode([t]) in top)
        out.append(best)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens).startswith(r.choices[0].text[:1])


def test_chat_logprobs_and_top_logprobs(kit, ref):
    c = kit.client()
    msgs = [{"role": "user", "content": "Write a function."}]
    r = kit.run(c.chat.completions.create(model=kit.adapter, messages=msgs, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=4))
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    ids = kit.engine.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    row = torch.log_softmax(ref(kit.adapter, ids), -1)
    first = content[0]
    assert math.isclose(first.logprob, float(row.max()), abs_tol=1e-4) and len(first.top_logprobs) == 4
    assert [t.logprob for t in first.top_logprobs] == pytest.approx(row.topk(4).values.tolist(), abs=1e-4)
    assert first.bytes == list(first.token.encode())
    plain = kit.run(c.chat.completions.create(model=kit.adapter, messages=msgs, max_tokens=5, temperature=0))
    assert plain.choices[0].logprobs is None


def test_n_samples_and_top_k(kit):
    c = kit.client()
    kw = dict(model=kit.base, prompt=PROMPT, max_tokens=12)
    greedy = kit.run(c.completions.create(**kw, temperature=0)).choices[0].text
    top1 = kit.run(c.completions.create(**kw, temperature=1.0, n=3, extra_body={"top_k": 1}))
    assert [ch.index for ch in top1.choices] == [0, 1, 2]
    assert [ch.text for ch in top1.choices] == [greedy] * 3  # top_k=1 at temperature 1: three greedy samples
    free = kit.run(c.completions.create(**kw, temperature=1.0, n=3, seed=5))
    again = kit.run(c.completions.create(**kw, temperature=1.0, n=3, seed=5))
    texts = [ch.text for ch in free.choices]
    assert texts == [ch.text for ch in again.choices] and len(set(texts)) > 1  # distinct, reproducible
    assert free.usage.completion_tokens == 3 * 12 or all(ch.finish_reason for ch in free.choices)
    assert free.usage.prompt_tokens == len(ids_of(kit, PROMPT))  # the prompt counted once, not per sample


def test_min_p_one_is_greedy(kit):
    c = kit.client()
    kw = dict(model=kit.adapter, prompt=PROMPT, max_tokens=10)
    greedy = kit.run(c.completions.create(**kw, temperature=0)).choices[0].text
    r = kit.run(c.completions.create(**kw, temperature=1.5, n=2, extra_body={"min_p": 1.0}))
    assert [ch.text for ch in r.choices] == [greedy, greedy]


def test_list_of_prompts_gives_a_choice_per_prompt_and_sample(kit):
    c = kit.client()
    prompts = ["import os\n", "def ", "class "]
    r = kit.run(c.completions.create(model=kit.base, prompt=prompts, max_tokens=6, temperature=0, n=2))
    assert [ch.index for ch in r.choices] == list(range(6))
    for i, p in enumerate(prompts):
        alone = kit.run(c.completions.create(model=kit.base, prompt=ids_of(kit, p), max_tokens=6, temperature=0))
        assert r.choices[2 * i].text == r.choices[2 * i + 1].text == alone.choices[0].text


def test_streaming_n_and_logprobs_concatenate_to_the_full_answer(kit):
    c = kit.client()
    msgs = [{"role": "user", "content": "Write a function."}]
    kw = dict(model=kit.adapter, messages=msgs, max_tokens=8, temperature=0, n=2, logprobs=True)

    async def go():
        parts, lps, finish = {}, {}, {}
        stream = await c.chat.completions.create(**kw, stream=True)
        async for chunk in stream:
            for ch in chunk.choices:
                parts[ch.index] = parts.get(ch.index, "") + (ch.delta.content or "")
                if ch.logprobs:
                    lps.setdefault(ch.index, []).extend(x.logprob for x in ch.logprobs.content)
                if ch.finish_reason:
                    finish[ch.index] = ch.finish_reason
        return parts, lps, finish

    parts, lps, finish = kit.run(go())
    full = kit.run(c.chat.completions.create(**kw))
    assert parts == {ch.index: ch.message.content for ch in full.choices}
    assert lps[0] == pytest.approx([x.logprob for x in full.choices[0].logprobs.content], abs=1e-5)
    assert set(finish) == {0, 1}


def test_tool_role_message_is_accepted(kit):
    c = kit.client()
    msgs = [{"role": "user", "content": "what is 2+2?"},
            {"role": "assistant", "content": None},
            {"role": "tool", "content": "4", "tool_call_id": "call-1"}]
    r = kit.run(c.chat.completions.create(model=kit.base, messages=msgs, max_tokens=3))
    assert r.usage.prompt_tokens > 5 and r.choices[0].message.role == "assistant"


def test_get_model_by_id(kit):
    import openai

    acme, globex = kit.client(K.ACME), kit.client(K.GLOBEX)
    assert kit.run(acme.models.retrieve(kit.base)).id == kit.base
    m = kit.run(acme.models.retrieve(kit.adapter))
    assert m.id == kit.adapter and m.owned_by == "public"
    assert kit.run(globex.models.retrieve("globex-secret")).owned_by == "globex"
    for client, name in ((acme, "globex-secret"), (acme, "no-such"), (acme, "other:" + kit.adapter)):
        with pytest.raises(openai.NotFoundError) as e:
            kit.run(client.models.retrieve(name))
        assert e.value.code == "model_not_found"
