"""Limits before work, strict types and OpenAI error bodies, through the real data plane (registry, replica
logic, engine; no Ray) with the official `openai` client. Each limit answers without reaching the engine."""

import asyncio
import json
import time

import httpx
import openai
import pytest

from tests.deployments import data_plane_kit as K


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    kit = K.build(tmp_path_factory.mktemp("limits"), max_request_bytes=64 * 1024)
    yield kit
    K.close(kit)


def post(kit, path, body=None, content=None, headers=None):
    async def go():
        async with kit.http() as http:
            h = {"Authorization": f"Bearer {K.ACME}", **(headers or {})}
            return await http.post(path, json=body, content=content, headers=h)
    return kit.run(go())


def assert_openai_error(r, status, code=None, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def engine_steps(kit):
    return kit.engine.stats()["num_steps"]


def test_body_over_the_limit_is_413_before_it_is_read(kit):
    steps = engine_steps(kit)
    big = {"model": kit.base, "messages": [{"role": "user", "content": "x" * 200_000}]}
    t0 = time.perf_counter()
    assert_openai_error(post(kit, "/v1/chat/completions", big), 413, "request_too_large")
    # no Content-Length (chunked): counted as it arrives and cut off at the limit
    async def chunks():
        for _ in range(100):
            yield b"[" + b"1," * 2000 + b"1]"
    assert_openai_error(post(kit, "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}),
                        413, "request_too_large")
    assert time.perf_counter() - t0 < 1.0 and engine_steps(kit) == steps
    text = kit.run(_get(kit, "/metrics"))
    assert 'loraserve_http_errors_total{code="request_too_large",status="413"} 2.0' in text


async def _get(kit, path, headers=None):
    async with kit.http() as http:
        return (await http.get(path, headers=headers or {})).text


def test_prompt_longer_than_any_fitting_prompt_is_refused_before_tokenizing(kit):
    max_len, max_chars = kit.server.prompts.max_len, kit.server.prompts.max_chars
    steps = engine_steps(kit)
    calls = []
    tok = kit.engine.tokenizer
    original = type(tok).__call__
    type(tok).__call__ = lambda self, *a, **kw: calls.append(1) or original(self, *a, **kw)  # counts tokenizer calls
    try:
        r = post(kit, "/v1/completions", {"model": kit.base, "prompt": "y" * (max_chars + 1), "max_tokens": 1})
    finally:
        type(tok).__call__ = original
    assert max_chars + 1 < 64 * 1024, "the test needs a body under the 413 limit"
    assert assert_openai_error(r, 400, "context_length_exceeded")["param"] == "prompt"  # as OpenAI names it
    assert calls == [] and engine_steps(kit) == steps
    ids = post(kit, "/v1/completions", {"model": kit.base, "prompt": [5] * max_len, "max_tokens": 1})
    assert assert_openai_error(ids, 400, "context_length_exceeded")["param"] == "prompt"
    chat = post(kit, "/v1/chat/completions", {"model": kit.base, "max_tokens": 1,
                                              "messages": [{"role": "user", "content": "y" * (max_chars + 1)}]})
    assert assert_openai_error(chat, 400, "context_length_exceeded")["param"] == "messages"


def test_max_tokens_beyond_the_context_is_400_like_vllm(kit):
    max_len = kit.server.prompts.max_len
    c = kit.client()
    with pytest.raises(openai.BadRequestError) as e:
        kit.run(c.completions.create(model=kit.base, prompt="def ", max_tokens=max_len))
    assert e.value.code == "context_length_exceeded" and e.value.body["param"] == "max_tokens"
    assert f"maximum context length is {max_len} tokens" in e.value.message
    # the default max_tokens is cut to the room left instead (a prompt of max_len - 3 tokens gets 3)
    r = kit.run(c.completions.create(model=kit.base, prompt=[7] * (max_len - 3)))
    assert r.usage.completion_tokens <= 3


@pytest.mark.parametrize("field,value", [
    ("max_tokens", True), ("n", True), ("seed", 2**70), ("seed", 1.5), ("temperature", "1"), ("top_k", False),
    ("logprobs", True), ("stream", 1), ("max_tokens", 2.0), ("presence_penalty", 3), ("logit_bias", {"x": 1}),
    ("logit_bias", {"5": 101}),
])
def test_strict_types_and_ranges_are_400_naming_the_parameter(kit, field, value):
    r = post(kit, "/v1/completions", {"model": kit.base, "prompt": "x", field: value})
    assert_openai_error(r, 400, param=field)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "a \ud800 b"}, "prompt"),
    ("/v1/completions", {"prompt": "ok", "stop": ["\udfff"]}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud83d"}]}, "messages"),
])
def test_lone_surrogates_are_400(kit, path, body, param):
    raw = json.dumps({"model": kit.base, **body}).encode()  # json.dumps escapes them as \\udxxx, as clients do
    r = post(kit, path, content=raw, headers={"Content-Type": "application/json"})
    assert_openai_error(r, 400, param=param)


@pytest.mark.parametrize("path,extra,param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice"),
    ("/v1/chat/completions", {"parallel_tool_calls": True}, "parallel_tool_calls"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"audio": {"voice": "x"}}, "audio"),
    ("/v1/completions", {"echo": True}, "echo"),
    ("/v1/completions", {"suffix": "end"}, "suffix"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"made_up_field": 1}, "made_up_field"),
])
def test_unimplemented_parameters_are_400_naming_them(kit, path, extra, param):
    body = {"model": kit.base, **({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path
                                  else {"prompt": "hi"}), **extra}
    err = assert_openai_error(post(kit, path, body), 400, param=param)
    assert param in err["message"]


def test_every_error_is_openai_json_and_counted_by_reason(kit):
    async def go():
        async with kit.http() as http:
            out = [await http.post("/v1/completions", json={"model": kit.base, "prompt": "x"}),  # no key
                   await http.get("/v1/nowhere", headers={"Authorization": f"Bearer {K.ACME}"}),
                   await http.delete("/v1/completions", headers={"Authorization": f"Bearer {K.ACME}"}),
                   await http.post("/v1/completions", content=b"{oops", headers={
                       "Authorization": f"Bearer {K.ACME}", "Content-Type": "application/json"})]
            return out, (await http.get("/metrics")).text
    (unauth, missing, method, broken), text = kit.run(go())
    assert_openai_error(unauth, 401, "invalid_api_key")
    assert_openai_error(missing, 404, "not_found")
    assert_openai_error(method, 405, "method_not_allowed")
    assert_openai_error(broken, 400)
    for series in ('loraserve_http_errors_total{code="invalid_api_key",status="401"}',
                   'loraserve_http_errors_total{code="not_found",status="404"}',
                   'loraserve_http_errors_total{code="method_not_allowed",status="405"}'):
        assert series in text, series


def test_tokenization_does_not_block_the_replica_event_loop(kit):
    """While a long prompt is tokenized, the replica's event loop keeps ticking (tokenizing runs in a thread)."""
    max_chars = kit.server.prompts.max_chars
    prompt = "word " * (min(max_chars, 60_000) // 5)
    tok = kit.engine.tokenizer
    original = type(tok).__call__

    def slow(self, *a, **kw):
        time.sleep(0.5)  # a slow tokenizer: this would freeze every stream if it ran on the loop
        return original(self, *a, **kw)

    async def go():
        gaps, stop = [], False

        async def ticker():
            last = time.perf_counter()
            while not stop:
                await asyncio.sleep(0.01)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        t = asyncio.ensure_future(ticker())
        async with kit.http() as http:
            r = await http.post("/v1/completions", json={"model": kit.base, "prompt": prompt, "max_tokens": 1},
                                headers={"Authorization": f"Bearer {K.ACME}"})
        stop = True
        await t
        return r, max(gaps)

    type(tok).__call__ = slow
    try:
        r, worst = kit.run(go())
    finally:
        type(tok).__call__ = original
    assert r.status_code in (200, 400), r.text
    assert worst < 0.3, f"the event loop stalled {worst:.2f} s"


def test_logit_bias_outside_the_vocabulary_is_400_before_any_token(kit):
    from engine_ext.model_config import load_model_spec

    vocab = load_model_spec(kit.engine.config.model).vocab_size
    steps = engine_steps(kit)
    r = post(kit, "/v1/completions", {"model": kit.base, "prompt": "x", "logit_bias": {str(vocab): 1.0}})
    err = assert_openai_error(r, 400, "invalid_request")
    assert "logit_bias" in err["message"] and err["param"] == "logit_bias" and engine_steps(kit) == steps


def test_malformed_json_and_stream_options_without_stream_are_400_naming_what_is_wrong(kit):
    async def raw(body: bytes):
        async with kit.http() as http:
            return await http.post("/v1/completions", content=body, headers={
                "Authorization": f"Bearer {K.ACME}", "Content-Type": "application/json"})

    r = kit.run(raw(b'{"model": "x", "prompt": "a",,}'))
    err = assert_openai_error(r, 400, "invalid_request")
    assert err["param"] is None and "not valid JSON" in err["message"]  # no character offset as the param
    r = post(kit, "/v1/completions", {"model": kit.base, "prompt": "x", "stream_options": {"include_usage": True}})
    assert assert_openai_error(r, 400, "invalid_request")["param"] == "stream_options"


def test_one_request_id_header_and_public_docs_without_the_control_plane(kit):
    async def go():
        async with kit.http() as http:
            body = {"model": kit.base, "prompt": "x", "max_tokens": 1}
            auth = {"Authorization": f"Bearer {K.ACME}"}
            mine = await http.post("/v1/completions", json=body, headers=auth)
            given = await http.post("/v1/completions", json=body, headers=auth | {"x-request-id": "from-proxy"})
            return mine, given, await http.get("/docs"), await http.get("/openapi.json")

    mine, given, docs, spec = kit.run(go())
    assert mine.headers.get_list("x-request-id") == [mine.json()["id"]]
    # Serve's proxy sets x-request-id on the request and echoes it: the app adds no second one
    assert given.status_code == 200 and given.headers.get_list("x-request-id") == []
    assert docs.status_code == 200 and "POST /v1/chat/completions" in docs.text and "<script" not in docs.text
    assert not [p for p in spec.json()["paths"] if p.startswith("/admin")]
