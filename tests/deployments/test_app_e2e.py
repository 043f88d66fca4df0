"""The real app through the official `openai` client: data plane, errors, tenants, limits,
control plane, change feed and /metrics. One shared Serve app (see serve_harness)."""

import concurrent.futures as cf
import time

import httpx
import openai
import pytest

from tests.deployments.serve_harness import ADMIN, KEYS

pytestmark = pytest.mark.slow
ACME, GLOBEX, LIMITED = list(KEYS)[:3]
CHAT = [{"role": "user", "content": "Write a function that adds two numbers."}]


def client(app, key=ACME, **kw):
    return openai.OpenAI(base_url=app.base_url + "/v1", api_key=key, max_retries=0, timeout=60, **kw)


def demo_adapter(app):
    return sorted(app.demo_adapters)[0]


def still_serving(app):
    r = client(app).completions.create(model=app.base_name, prompt="def ", max_tokens=2)
    assert r.choices[0].text is not None


def test_chat_completion_with_demo_adapter(serve_app):
    c = client(serve_app)
    r = c.chat.completions.create(model=f"{serve_app.base_name}:{demo_adapter(serve_app)}", messages=CHAT,
                                  max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completions_are_deterministic_and_adapter_changes_output(serve_app):
    c = client(serve_app)
    kw = dict(prompt="import os\n", max_tokens=16, temperature=0)
    base = c.completions.create(model=serve_app.base_name, **kw)
    again = c.completions.create(model=serve_app.base_name, **kw)
    assert base.choices[0].text == again.choices[0].text
    outs = {(prompt, c.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0).choices[0].text)
            for name in [serve_app.base_name, *sorted(serve_app.demo_adapters)]
            for prompt in ("import os\n", "def main():", "The ")}
    assert len(outs) > 3  # adapters change the output (for at least one of the prompts)


def test_stop_seed_temperature_top_p_and_length(serve_app):
    c = client(serve_app)
    r = c.completions.create(model=serve_app.base_name, prompt="import os\n", max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    kw = dict(model=serve_app.base_name, prompt="def ", max_tokens=12, temperature=1.0, top_p=0.9, seed=42)
    assert c.completions.create(**kw).choices[0].text == c.completions.create(**kw).choices[0].text
    sampled = dict(model=serve_app.base_name, prompt="import os\n", max_tokens=16, temperature=1.0, seed=3)
    full = c.completions.create(**sampled).choices[0].text
    stop = next((ch for ch in full if ch != full[0]), None)
    assert stop is not None, f"need a varied continuation to test stop, got {full!r}"
    cut = c.completions.create(**sampled, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_streaming_arrives_incrementally(serve_app):
    c = client(serve_app)
    arrivals, pieces = [], []
    stream = c.chat.completions.create(model=demo_adapter(serve_app), messages=CHAT, max_tokens=24, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    usage = None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
            arrivals.append(time.perf_counter())
    assert len(pieces) >= 3 and usage is not None and usage.completion_tokens >= len(pieces)
    assert arrivals[-1] > arrivals[0]  # several chunks, not one buffered body
    full = c.chat.completions.create(model=demo_adapter(serve_app), messages=CHAT, max_tokens=24, temperature=0)
    assert "".join(pieces) == full.choices[0].message.content


def test_models_lists_base_and_visible_adapters(serve_app):
    ids = {m.id for m in client(serve_app).models.list().data}
    assert serve_app.base_name in ids and set(serve_app.demo_adapters) <= ids
    assert "globex-private" not in ids
    assert "globex-private" in {m.id for m in client(serve_app, GLOBEX).models.list().data}


@pytest.mark.parametrize(
    "key,model,exc,status,code",
    [
        (ACME, "no-such-adapter", openai.NotFoundError, 404, "model_not_found"),
        (ACME, "globex-private", openai.NotFoundError, 404, "model_not_found"),  # another tenant's
        (ACME, "/etc/passwd", openai.NotFoundError, 404, "model_not_found"),
        ("sk-wrong-key-000", "demo", openai.AuthenticationError, 401, "invalid_api_key"),
    ],
)
def test_errors_are_openai_format(serve_app, key, model, exc, status, code):
    with pytest.raises(exc) as e:
        client(serve_app, key).chat.completions.create(model=model, messages=CHAT, max_tokens=2)
    assert e.value.status_code == status and e.value.code == code
    assert e.value.body["message"] and e.value.body["type"]
    still_serving(serve_app)


def test_private_adapter_serves_its_owner(serve_app):
    r = client(serve_app, GLOBEX).completions.create(model="globex-private", prompt="def ", max_tokens=2)
    assert r.usage.completion_tokens == 2


def test_malformed_bodies(serve_app):
    with pytest.raises(openai.BadRequestError) as e:
        client(serve_app).completions.create(model=serve_app.base_name, prompt="x", max_tokens=2, n=17)
    assert e.value.status_code == 400 and e.value.body["param"] == "n"
    r = httpx.post(serve_app.base_url + "/v1/chat/completions", content=b"{oops",
                   headers={"Authorization": f"Bearer {ACME}", "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    still_serving(serve_app)


def test_rate_limited_tenant_gets_429_with_retry_after(serve_app):
    c = client(serve_app, LIMITED)
    codes = []
    for _ in range(3):
        try:
            c.completions.create(model=serve_app.base_name, prompt="x", max_tokens=1)
            codes.append(200)
        except openai.RateLimitError as e:
            codes.append(e.status_code)
            assert e.code == "rate_limit_exceeded" and int(e.response.headers["retry-after"]) >= 1
    assert codes == [200, 200, 429]
    still_serving(serve_app)  # other tenants unaffected


def _admin(app, method, path, **kw):
    r = httpx.request(method, f"{app.base_url}/admin/v1{path}", headers={"Authorization": f"Bearer {ADMIN}"},
                      timeout=30, **kw)
    assert r.status_code < 300, r.text
    return r.json()


def _wait_replicas(app, predicate, timeout=5.0):
    """Seconds until every LLM replica's stats satisfy `predicate`; fails after `timeout`."""
    t0 = time.monotonic()
    while True:
        stats = app.replica_stats()
        if len(stats) >= 2 and all(predicate(s) for s in stats.values()):
            return time.monotonic() - t0
        assert time.monotonic() - t0 < timeout, stats
        time.sleep(0.1)


def test_control_plane_needs_admin_token(serve_app):
    r = httpx.post(f"{serve_app.base_url}/admin/v1/adapters/promo/rollback", headers={"Authorization": f"Bearer {ACME}"})
    assert r.status_code == 401


def served_version(c, model):
    """(version that served the request, its text), from the x-loraserve-adapter header."""
    raw = c.completions.with_raw_response.create(model=model, prompt="def main():", max_tokens=12, temperature=0)
    return raw.headers["x-loraserve-adapter"], raw.parse().choices[0].text


def test_promote_rollback_disable_reach_every_replica(serve_app):
    c = client(serve_app)
    assert served_version(c, "promo")[0] == "promo@1"
    v1_text = served_version(c, "promo")[1]
    v2_text = served_version(c, sorted(serve_app.demo_adapters)[1])[1]  # the files promo v2 was built from
    # warm v1 on every replica so each has something to drop
    assert any("promo@1" in s["host_adapters"] for s in serve_app.replica_stats().values())

    with cf.ThreadPoolExecutor(4) as pool:  # in-flight requests across the promote
        inflight = [pool.submit(c.completions.create, model="promo", prompt="def main():", max_tokens=48,
                                temperature=0) for _ in range(4)]
        time.sleep(0.05)
        _admin(serve_app, "POST", "/adapters/promo/promote", json={"version": 2})
        took = _wait_replicas(serve_app, lambda s: "promo@1" not in s["host_adapters"])
        assert all(f.result().usage.completion_tokens >= 1 for f in inflight)
    print(f"promote reached every replica in {took:.2f} s")
    assert took < 5.0
    assert served_version(c, "promo") == ("promo@2", v2_text)

    _admin(serve_app, "POST", "/adapters/promo/rollback")
    _wait_replicas(serve_app, lambda s: "promo@2" not in s["host_adapters"])
    assert served_version(c, "promo") == ("promo@1", v1_text)

    _admin(serve_app, "POST", "/adapters/promo/disable")
    _wait_replicas(serve_app, lambda s: "promo" in s["disabled"] and not any(
        k.startswith("promo@") for k in s["host_adapters"]))
    with pytest.raises(openai.PermissionDeniedError) as e:
        c.completions.create(model="promo", prompt="x", max_tokens=2)
    assert e.value.status_code == 403 and e.value.code == "model_disabled"
    _admin(serve_app, "POST", "/adapters/promo/enable")
    _wait_replicas(serve_app, lambda s: "promo" not in s["disabled"])
    assert served_version(c, "promo") == ("promo@1", v1_text)


def test_metrics_after_traffic(serve_app):
    c = client(serve_app)
    name = demo_adapter(serve_app)
    for _ in range(3):
        c.completions.create(model=name, prompt="def ", max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="no-such-adapter", prompt="x", max_tokens=1)
    text = httpx.get(serve_app.base_url + "/metrics").text
    series = [
        f'loraserve_requests_total{{adapter="{name}",status="200",tenant="private"}}',
        f'loraserve_ttft_seconds_count{{adapter="{name}",tenant="private"}}',
        f'loraserve_inter_token_seconds_count{{adapter="{name}",tenant="private"}}',
        f'loraserve_completion_tokens_total{{adapter="{name}",tenant="private"}}',
        f'loraserve_queue_seconds_count{{adapter="{name}",tenant="private"}}',
        f'loraserve_tokens_per_second_count{{adapter="{name}",tenant="private"}}',
        'loraserve_errors_total{adapter="-",code="model_not_found",tenant="private"}',
        "loraserve_batch_size_count",
        "loraserve_replica_free_kv_blocks{",
        "loraserve_adapter_hits_total{",
        "loraserve_adapter_loads_total{",
        "loraserve_adapter_load_seconds_total{",
    ]
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    for s in series:
        hits = [v for k, v in values.items() if k.startswith(s) or k == s]
        assert hits and max(hits) > 0, s
    assert values[series[0]] >= 3


def test_open_metrics_name_no_private_adapter_and_no_tenant(serve_app):
    """After traffic to a tenant-private adapter, no series of an unauthenticated /metrics (the replicas' timer
    reports and the placement tiers included) names it or any tenant."""
    c = client(serve_app, key=GLOBEX)
    for _ in range(3):
        c.completions.create(model="globex-private", prompt="def ", max_tokens=2)
        c.completions.create(model=demo_adapter(serve_app), prompt="def ", max_tokens=2)  # a public one beside it
    deadline, series = time.monotonic() + 30, []
    while time.monotonic() < deadline:  # replicas report on a timer, the controller tiers once a period
        text = httpx.get(serve_app.base_url + "/metrics").text
        series = [line for line in text.splitlines() if line and not line.startswith("#")]
        if any(line.startswith("loraserve_adapter_tier{") for line in series) and \
                any(line.startswith("loraserve_replica_adapter_tokens_total{") for line in series):
            break
        time.sleep(1)
    assert any(line.startswith("loraserve_adapter_tier{") for line in series)  # the gauge is there, public only
    assert any('adapter="private"' in line for line in series)
    assert not [line for line in series if "globex-private" in line]
    for tenant in sorted(set(KEYS.values())):  # no label value is a tenant's name
        assert not [line for line in series if f'="{tenant}"' in line], tenant
