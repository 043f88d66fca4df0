"""The data plane's HTTP behaviour with fake neighbours (the real app is in test_app_e2e)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import asyncio
import json
import time

import pytest
from fastapi.testclient import TestClient

from deployments.data_plane.openai_api import IngressDeps, create_openai_app
from deployments.data_plane.rate_limit import ColdLoadGate, RateLimiter, RefusalHold
from serving_fakes import Disabled, FakeLLM, FakeResolver, NotFound, Rec

KEY, OTHER = "sk-test-tenant-a", "sk-test-tenant-b"
H = {"Authorization": f"Bearer {KEY}"}


def make(llm=None, tenant_rate=(100, 100), adapter_rate=(100, 100), hold=None):
    resolver = FakeResolver({
        "pub": Rec("pub", 3),
        "mine": Rec("mine", 1, owner_tenant="a", visibility="tenant"),
        "theirs": Rec("theirs", 1, owner_tenant="b", visibility="tenant"),
        "off": Rec("off", 1, disabled=True),
        "otherbase": Rec("otherbase", 1, base_model="big"),
    })
    llm = llm or FakeLLM()
    deps = IngressDeps(base_name="tiny", api_keys={KEY: "a", OTHER: "b"}, resolver=resolver, llm=llm,
                       limiter=RateLimiter(tenant_rate, adapter_rate), gate=ColdLoadGate(limit=2, wait_s=0.2),
                       registry_errors=(NotFound, Disabled), hold=hold or RefusalHold())
    return TestClient(create_openai_app(deps)), llm, deps


def assert_openai_error(r, status, code):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["code"] == code


def test_completion_with_adapter_resolves_version_and_usage():
    client, llm, _ = make()
    r = client.post("/v1/completions", headers=H, json={"model": "tiny:pub", "prompt": "a b c d", "max_tokens": 2,
                                                        "stop": "x", "seed": 7, "temperature": 0.5, "top_p": 0.9})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "tiny:pub"
    assert body["choices"][0]["text"] == "a b " and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    req = llm.seen[-1]
    assert req.adapter_key == "pub@3"
    assert req.sampling == {"max_tokens": 2, "temperature": 0.5, "top_p": 0.9, "seed": 7, "stop": ["x"], "top_k": -1,
                            "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                            "repetition_penalty": 1.0, "logit_bias": {}, "logprobs": None}
    assert req.max_tokens_explicit and req.n == 1


@pytest.mark.parametrize("model,key", [("pub", "pub@3"), ("mine", "mine@1"), ("tiny", None)])
def test_model_forms(model, key):
    client, llm, _ = make()
    r = client.post("/v1/chat/completions", headers=H, json={"model": model, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "hi "}
    assert llm.seen[-1].adapter_key == key and llm.seen[-1].messages == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "model,status,code",
    [
        ("nope", 404, "model_not_found"),
        ("theirs", 404, "model_not_found"),  # another tenant's private adapter
        ("off", 403, "model_disabled"),
        ("big:pub", 404, "model_not_found"),
        ("otherbase", 404, "model_not_found"),
        ("../../etc/passwd", 404, "model_not_found"),
        ("s3://bucket/x", 404, "model_not_found"),
        ("/tmp/adapter", 404, "model_not_found"),
    ],
)
def test_model_errors(model, status, code):
    client, llm, _ = make()
    r = client.post("/v1/completions", headers=H, json={"model": model, "prompt": "x"})
    assert_openai_error(r, status, code)
    assert llm.seen == []


def test_auth():
    client, llm, _ = make()
    for headers in ({}, {"Authorization": "Bearer wrong-key-123"}, {"Authorization": KEY}):
        assert_openai_error(client.post("/v1/completions", headers=headers, json={"model": "pub", "prompt": "x"}),
                            401, "invalid_api_key")
    assert_openai_error(client.get("/v1/models"), 401, "invalid_api_key")
    # auth comes before body validation
    assert_openai_error(client.post("/v1/completions", json={"bad": 1}), 401, "invalid_api_key")


@pytest.mark.parametrize(
    "body",
    [
        {"model": "pub"},
        {"model": "pub", "prompt": "x", "n": 17},
        {"model": "pub", "prompt": "x", "temperature": 5},
        {"model": "pub", "prompt": "x", "max_tokens": 0},
        {"model": "pub", "prompt": "x", "max_tokens": 100000},
        {"model": "pub", "prompt": ["a", "b"] * 40},
        {"model": "pub", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]},
        {"model": "pub", "prompt": "x", "logprobs": 21},
        {"model": "pub", "prompt": "x", "echo": True},
    ],
)
def test_malformed_bodies(body):
    client, llm, _ = make()
    r = client.post("/v1/completions", headers=H, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert llm.seen == []


def test_not_json():
    client, _, _ = make()
    r = client.post("/v1/chat/completions", headers={**H, "Content-Type": "application/json"}, content=b"{not json")
    assert r.status_code == 400 and "error" in r.json()


def test_models_lists_base_and_visible_adapters():
    client, _, _ = make()
    ids = [m["id"] for m in client.get("/v1/models", headers=H).json()["data"]]
    assert ids[0] == "tiny" and set(ids[1:]) == {"pub", "mine", "off"}
    ids_b = {m["id"] for m in client.get("/v1/models", headers={"Authorization": f"Bearer {OTHER}"}).json()["data"]}
    assert "theirs" in ids_b and "mine" not in ids_b


def test_tenant_rate_limit_429_with_retry_after_and_recovery():
    client, llm, deps = make(tenant_rate=(1, 2))
    ok = [client.post("/v1/completions", headers=H, json={"model": "tiny", "prompt": "x"}).status_code for _ in range(2)]
    assert ok == [200, 200]
    r = client.post("/v1/completions", headers=H, json={"model": "tiny", "prompt": "x"})
    assert_openai_error(r, 429, "rate_limit_exceeded")
    assert int(r.headers["Retry-After"]) >= 1
    # the other tenant is unaffected
    r = client.post("/v1/completions", headers={"Authorization": f"Bearer {OTHER}"}, json={"model": "tiny", "prompt": "x"})
    assert r.status_code == 200


def test_adapter_rate_limit_is_shared_across_tenants():
    client, _, _ = make(adapter_rate=(1, 1))
    assert client.post("/v1/completions", headers=H, json={"model": "pub", "prompt": "x"}).status_code == 200
    r = client.post("/v1/completions", headers={"Authorization": f"Bearer {OTHER}"}, json={"model": "pub", "prompt": "x"})
    assert_openai_error(r, 429, "rate_limit_exceeded")
    assert client.post("/v1/completions", headers=H, json={"model": "tiny", "prompt": "x"}).status_code == 200


def test_streaming_sse():
    client, _, _ = make()
    with client.stream("POST", "/v1/chat/completions", headers=H,
                       json={"model": "pub", "messages": [{"role": "user", "content": "one two three"}], "stream": True,
                             "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "one two three "
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["usage"]["completion_tokens"] == 3


def test_replica_error_before_first_token_is_an_http_error():
    llm = FakeLLM(fail_with={"type": "error", "status": 400, "code": "context_length_exceeded", "message": "too long"})
    client, _, _ = make(llm)
    assert_openai_error(client.post("/v1/completions", headers=H, json={"model": "pub", "prompt": "x"}),
                        400, "context_length_exceeded")


def test_metrics_after_traffic():
    client, _, _ = make()
    client.post("/v1/completions", headers=H, json={"model": "pub", "prompt": "a b", "max_tokens": 4})
    client.post("/v1/completions", headers=H, json={"model": "nope", "prompt": "a"})
    text = client.get("/metrics").text  # open: no tenant's name
    assert 'loraserve_requests_total{adapter="pub",status="200",tenant="private"} 1.0' in text
    assert 'loraserve_errors_total{adapter="-",code="model_not_found",tenant="private"} 1.0' in text
    assert 'loraserve_ttft_seconds_count{adapter="pub",tenant="private"} 1.0' in text
    assert 'loraserve_completion_tokens_total{adapter="pub",tenant="private"} 2.0' in text
    assert 'tenant="a"' not in text
    assert 'loraserve_adapter_hits_total{adapter="pub@3",replica="r0"} 4.0' in text
    assert 'loraserve_spec_acceptance_rate{adapter="pub@3",replica="r0"} 0.75' in text
    assert 'loraserve_adapter_load_seconds_total{adapter="pub@3",replica="r0"} 0.5' in text
    assert 'loraserve_batch_size_count 1.0' in text


def test_metrics_with_a_token_name_the_tenant():
    client, _, deps = make()
    deps.metrics_token = "metrics-token-1"
    client.post("/v1/completions", headers=H, json={"model": "pub", "prompt": "a b", "max_tokens": 4})
    assert client.get("/metrics").status_code == 401
    text = client.get("/metrics", headers={"Authorization": "Bearer metrics-token-1"}).text
    assert 'loraserve_requests_total{adapter="pub",status="200",tenant="a"} 1.0' in text


def test_unknown_route_is_openai_error():
    client, _, _ = make()
    assert_openai_error(client.get("/v1/nothing", headers=H), 404, "not_found")


class BrokenLLM:
    async def stream(self, req):
        raise ConnectionError("replica actor died")
        yield  # an async generator that fails on its first step


def test_transport_failure_is_503_and_the_app_keeps_serving():
    client, _, deps = make(BrokenLLM())
    assert_openai_error(client.post("/v1/completions", headers=H, json={"model": "pub", "prompt": "x"}),
                        503, "service_unavailable")
    deps.llm = FakeLLM()
    assert client.post("/v1/completions", headers=H, json={"model": "pub", "prompt": "x"}).status_code == 200


def test_cold_load_gate_caps_concurrent_requests_for_an_unloaded_adapter():
    import asyncio

    import httpx

    llm = FakeLLM(load_s=0.5)
    _, _, deps = make(llm)  # gate: 2 in flight, 0.2 s wait

    async def scenario():
        transport = httpx.ASGITransport(app=create_openai_app(deps))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            cold = [http.post("/v1/completions", headers=H, json={"model": "pub", "prompt": "a"}) for _ in range(3)]
            first = await asyncio.gather(*cold)
            warm = await asyncio.gather(*(http.post("/v1/completions", headers=H, json={"model": "pub", "prompt": "a"})
                                          for _ in range(3)))
        return first, warm

    first, warm = asyncio.run(scenario())
    codes = sorted(r.status_code for r in first)
    assert codes == [200, 200, 429]
    refused = next(r for r in first if r.status_code == 429)
    assert refused.json()["error"]["code"] == "adapter_loading" and refused.headers["retry-after"] == "1"
    assert [r.status_code for r in warm] == [200, 200, 200]  # loaded: no cap any more


def test_the_public_schema_lists_no_admin_route():
    from deployments.data_plane.ingress import add_placement_route

    client, _, deps = make()

    class Reporter:
        async def refresh(self):
            return {"version": 1, "adapters": {}}

    add_placement_route(client.app, Reporter(), "admin-token-1", "/admin")
    assert client.get("/admin/v1/placement", headers={"Authorization": "Bearer admin-token-1"}).json()["version"] == 1
    assert not [p for p in client.get("/openapi.json").json()["paths"] if p.startswith("/admin")]


def test_ready_reports_each_dependency_and_is_503_while_one_is_down():
    client, _, deps = make()
    assert client.get("/ready").json() == {"status": "ready", "dependencies": {}}
    state = {"registry metadata store": True, "registry blob store": False}
    deps.readiness = lambda: dict(state)
    r = client.get("/ready")
    assert r.status_code == 503 and r.json() == {"status": "not ready", "dependencies": {
        "registry metadata store": "up", "registry blob store": "down"}}
    assert client.get("/health").status_code == 200  # liveness is not readiness


def test_malformed_requests_count_against_the_callers_rate_limit():
    client, llm, _ = make(tenant_rate=(0.001, 5))
    codes = [client.post("/v1/completions", headers=H, json={"model": "tiny", "prompt": 5}).status_code
             for _ in range(8)]
    assert codes == [400] * 5 + [429] * 3  # the burst, then 429 before the body is even parsed
    r = client.post("/v1/completions", headers=H, json={"model": "tiny", "prompt": "x"})
    assert_openai_error(r, 429, "rate_limit_exceeded")
    assert client.post("/v1/completions", headers={"Authorization": f"Bearer {OTHER}"},
                       json={"model": "tiny", "prompt": "x"}).status_code == 200  # another tenant is not held up
    assert llm.seen and all(req.prompt == "x" for req in llm.seen)


def test_a_caller_refused_over_and_over_is_benched_before_its_body_is_read_and_others_are_not():
    # no 429 from the rate limit here: only 400s
    client, llm, deps = make(tenant_rate=(1000, 1000), hold=RefusalHold(hold_s=0.2, after=3, max_held=8))
    metric = deps.metrics.registry.get_sample_value
    codes = [client.post("/v1/completions", headers=H, json={"model": "tiny", "prompt": 5}).status_code
             for _ in range(7)]
    assert codes == [400] * 4 + [429] * 3  # the 4th refusal benched it: the next three are never parsed
    assert metric("loraserve_rate_limited_held_total") == 3
    assert metric("loraserve_rate_limited_total", {"scope": "refusals"}) == 3
    t0 = time.monotonic()
    r = client.post("/v1/completions", headers=H, json={"model": "tiny", "prompt": "x"})  # a valid one, benched too
    assert_openai_error(r, 429, "rate_limit_exceeded")
    assert time.monotonic() - t0 >= 0.2 and r.headers["Retry-After"] == "1" and not llm.seen
    other = {"Authorization": f"Bearer {OTHER}"}
    assert client.post("/v1/completions", headers=other, json={"model": "tiny", "prompt": "x"}).status_code == 200
    assert metric("loraserve_rate_limited_held_total") == 4 and deps.hold.held == 0
    time.sleep(0.25)  # waited out: its bench ended hold_s after its last request
    assert client.post("/v1/completions", headers=H, json={"model": "tiny", "prompt": "x"}).status_code == 200


def test_unknown_models_and_429s_count_towards_the_bench_a_401_does_not():
    client, _, deps = make(tenant_rate=(0.001, 2), hold=RefusalHold(hold_s=0.05, after=3, max_held=8))
    statuses = [client.post("/v1/completions", headers=H, json={"model": "tiny:nope", "prompt": "x"}).status_code
                for _ in range(2)]  # 404s, each taking a token
    statuses += [client.post("/v1/completions", headers=H, json={"model": "tiny", "prompt": "x"}).status_code
                 for _ in range(3)]  # the bucket is empty: 429, 429 (4th refusal: benched), then benched
    assert statuses == [404, 404, 429, 429, 429]
    assert deps.metrics.registry.get_sample_value("loraserve_rate_limited_total", {"scope": "refusals"}) == 1
    bad_key = {"Authorization": "Bearer sk-nobody-000000"}
    assert [client.post("/v1/completions", headers=bad_key, json={"model": "tiny", "prompt": "x"}).status_code
            for _ in range(5)] == [401] * 5  # no tenant to bench
    assert client.post("/v1/completions", headers={"Authorization": f"Bearer {OTHER}"},
                       json={"model": "tiny", "prompt": "x"}).status_code == 200


def test_refusal_hold_benches_per_caller_after_its_refusals_within_a_second():
    now = [0.0]
    hold = RefusalHold(hold_s=1.0, after=2, max_held=1, clock=lambda: now[0])
    for _ in range(2):
        hold.refused("a")
    assert not hold.benched("a")  # `after` refusals: not yet
    hold.refused("a")
    assert hold.benched("a") and not hold.benched("b")  # another caller has its own count
    now[0] = 0.9
    assert hold.benched("a")  # a request while benched extends the bench to hold_s from now
    now[0] = 1.8
    assert hold.benched("a") and hold.retry_after_s("a") == 1.0
    now[0] = 2.9  # hold_s after its last request: free again, and a new second's count starts over
    assert not hold.benched("a")
    for _ in range(2):
        hold.refused("a")
    assert not hold.benched("a")
    now[0] = 4.0  # refusals in different seconds do not add up
    hold.refused("a")
    assert not hold.benched("a")
    off = RefusalHold(hold_s=0, after=0)
    off.refused("a")
    assert not off.benched("a")  # hold_s 0: never benched


def test_refusal_hold_holds_at_most_max_held_answers_at_once():
    async def run():
        hold = RefusalHold(hold_s=0.05, after=0, max_held=2)
        return await asyncio.gather(*(hold.hold() for _ in range(3))), hold.held

    held, left = asyncio.run(run())
    assert sorted(held) == [False, True, True] and left == 0


BROKEN_JSON = b'{"model": "tiny", "messages": ['  # cut off: not JSON


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer sk-wrong-key-0000"}, {"Authorization": "Basic eDp5"}])
def test_a_body_that_is_not_json_without_a_valid_key_is_401_not_400(headers):
    client, llm, deps = make()
    r = client.post("/v1/chat/completions", content=BROKEN_JSON, headers={**headers, "Content-Type": "application/json"})
    assert_openai_error(r, 401, "invalid_api_key")
    assert "Bearer" in r.json()["error"]["message"]
    assert deps.metrics.registry.get_sample_value("loraserve_http_errors_total",
                                                  {"status": "401", "code": "invalid_api_key"}) == 1


def test_a_tenant_over_its_rate_gets_429_whatever_the_body():
    client, _, _ = make(tenant_rate=(0.001, 2))
    post = lambda: client.post("/v1/chat/completions", content=BROKEN_JSON,  # noqa: E731
                               headers={**H, "Content-Type": "application/json"})
    assert [post().status_code for _ in range(4)] == [400, 400, 429, 429]


def test_bodies_that_are_not_json_count_towards_the_callers_bench():
    client, llm, deps = make(tenant_rate=(1000, 1000), hold=RefusalHold(hold_s=0.2, after=3, max_held=8))
    codes = [client.post("/v1/chat/completions", content=BROKEN_JSON,
                         headers={**H, "Content-Type": "application/json"}).status_code for _ in range(6)]
    assert codes == [400] * 4 + [429] * 2


def test_the_bench_holds_the_failing_client_not_the_tenants_other_clients():
    """The rule: a caller is (tenant, client host). One client of a key that keeps sending invalid bodies is
    benched; another client on the same key, whose requests are valid, is served within the tenant's rate."""
    # a bench of 5 s, its answers not held (max_held 0): the test takes no time
    _, llm, deps = make(tenant_rate=(1000, 1000), hold=RefusalHold(hold_s=5, after=3, max_held=0))
    app = create_openai_app(deps)
    broken, good = TestClient(app, client=("10.0.0.1", 40000)), TestClient(app, client=("10.0.0.2", 40001))
    codes = [broken.post("/v1/completions", headers=H, json={"model": "tiny", "prompt": 5}).status_code
             for _ in range(6)]
    assert codes == [400] * 4 + [429] * 2
    assert good.post("/v1/completions", headers=H, json={"model": "tiny", "prompt": "x"}).status_code == 200
    # the same host on another port is the same client: still benched
    again = TestClient(app, client=("10.0.0.1", 40002))
    assert again.post("/v1/completions", headers=H, json={"model": "tiny", "prompt": "x"}).status_code == 429


def test_a_prompt_longer_than_the_replicas_bound_is_refused_at_the_ingress():
    client, llm, deps = make()
    client.post("/v1/completions", headers=H, json={"model": "tiny", "prompt": "x"})  # the bound asked of the replica
    bound = deps.prompt_bound.value
    assert bound == llm.bound and bound.max_chars == 2048 * 8
    seen = len(llm.seen)
    long_text = "y" * (bound.max_chars + 1)
    for path, body, param in [
        ("/v1/completions", {"model": "tiny", "prompt": long_text}, "prompt"),
        ("/v1/completions", {"model": "tiny", "prompt": ["short", long_text]}, "prompt"),
        ("/v1/completions", {"model": "tiny", "prompt": [3] * bound.max_model_len}, "prompt"),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": long_text}]}, "messages"),
    ]:
        r = client.post(path, headers=H, json=body)
        assert_openai_error(r, 400, "context_length_exceeded")
        assert r.json()["error"]["param"] == param
    assert len(llm.seen) == seen  # no replica saw them
    ok = client.post("/v1/completions", headers=H, json={"model": "tiny", "prompt": "y" * bound.max_chars})
    assert ok.status_code == 200, ok.text  # at the bound: the replica's tokenizer decides


@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty"])
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinite_numbers_are_refused_as_not_finite(field, value):
    client, llm, _ = make()
    body = ('{"model": "tiny", "prompt": "x", "%s": %s}' % (field, value)).encode()  # as Python's json writes them
    r = client.post("/v1/completions", headers={**H, "Content-Type": "application/json"}, content=body)
    assert_openai_error(r, 400, "invalid_request")
    err = r.json()["error"]
    assert err["param"] == field and "finite number" in err["message"], err
    assert llm.seen == []


def test_the_bench_forgets_idle_callers_so_many_client_hosts_cannot_grow_it():
    from deployments.data_plane import rate_limit

    now = [0.0]
    hold = RefusalHold(hold_s=5.0, after=2, clock=lambda: now[0])
    for i in range(rate_limit.MAX_TRACKED_CALLERS):
        hold.refused(f"t@10.0.{i // 256}.{i % 256}")
    for _ in range(3):
        hold.refused("t@busy")  # benched
    now[0] = 0.5
    hold.refused("t@one-more")  # counted while the others' second still runs: nothing to forget yet
    assert len(hold._window) == rate_limit.MAX_TRACKED_CALLERS + 2  # noqa: SLF001
    now[0] = 1.2
    hold.refused("t@late")  # the others' second is over; busy's bench (5 s) runs on
    assert set(hold._window) == {"t@one-more", "t@late"} and hold.benched("t@busy")  # noqa: SLF001
