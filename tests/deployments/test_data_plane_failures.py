"""Failures that lose no request, exact in-flight metrics, /metrics exposure and Redis-shared rate limits,
through the real data plane in one process (registry, replica logic, engine) and the official `openai` client.
A replica failure is injected where Ray would raise it: the transport around the real replica raises
`ReplicaUnavailable` (what `ServeLLMClient` turns Ray's actor errors into); test_replica_failure_load kills real
Serve replicas."""

import asyncio
import dataclasses
import logging
import re

import openai
import pytest

from deployments.dependency_health import DependencyHealth
from deployments.metrics import ServingMetrics
from deployments.data_plane.openai_api import create_openai_app
from deployments.data_plane.protocol import ReplicaUnavailable
from deployments.data_plane.rate_limit import RateLimiter, RedisRateLimiter
from tests.deployments import data_plane_kit as K


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    kit = K.build(tmp_path_factory.mktemp("failures"), retry_backoff_s=0.01)
    yield kit
    K.close(kit)


class FailingTransport:
    """The real replica behind a transport that fails `fail` times, after `after` chunks of the stream: the replica
    gone (`ReplicaUnavailable`, as Ray reports it), or its engine core gone (`core=True`: the error chunk the
    replica sends then)."""

    def __init__(self, inner, fail: int, after: int = 0, core: bool = False):
        self.inner, self.fail, self.after, self.core, self.calls = inner, fail, after, core, 0

    async def stream(self, req):
        from deployments.replica.errors import error_chunk_of
        from engine_ext import EngineDeadError

        self.calls += 1
        failing = self.calls <= self.fail
        n = 0
        async for chunk in self.inner.stream(req):
            if failing and n == self.after:
                if not self.core:
                    raise ReplicaUnavailable("ActorDiedError")
                yield error_chunk_of(EngineDeadError("the engine core (pid 1) exited with code -9"), req)
                return
            n += 1
            yield chunk


def app_with(kit, **changes):
    changes.setdefault("metrics", ServingMetrics())  # counters of this app alone
    deps = dataclasses.replace(kit.deps, **changes)
    return create_openai_app(deps), deps


def metric(text, name, **labels):
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            got = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
            if all(got.get(k) == v for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return None


async def scrape(kit, app, token=None):
    async with kit.http(app) as http:
        return (await http.get("/metrics", headers={"Authorization": f"Bearer {token}"} if token else {})).text


@pytest.mark.parametrize("core", [False, True], ids=["replica", "engine-core"])
@pytest.mark.parametrize("after", [0, 1, 3])  # before the start chunk, after it, after two deltas (not yet sent)
def test_replica_failure_before_the_client_saw_a_token_is_retried_transparently(kit, after, core):
    app, deps = app_with(kit, llm=FailingTransport(kit.deps.llm, fail=2, after=after, core=core))
    c = kit.client(app=app)
    kw = dict(model=kit.adapter, prompt="def main():", max_tokens=8, temperature=0)
    raw = kit.run(c.completions.with_raw_response.create(**kw))
    reference = kit.run(kit.client().completions.create(**kw))
    assert raw.parse().choices[0].text == reference.choices[0].text
    assert raw.headers["x-loraserve-retries"] == "2"
    text = kit.run(scrape(kit, app))
    assert metric(text, "loraserve_replica_failures_total", when="before_first_token") == 2


def test_streamed_request_retried_when_no_token_was_sent(kit):
    app, _ = app_with(kit, llm=FailingTransport(kit.deps.llm, fail=1, after=1))
    c = kit.client(app=app)

    async def go():
        stream = await c.chat.completions.create(model=kit.base, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=6, temperature=0, stream=True)
        return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])

    full = kit.run(kit.client().chat.completions.create(model=kit.base, messages=[{"role": "user", "content": "hi"}],
                                                        max_tokens=6, temperature=0))
    assert kit.run(go()) == full.choices[0].message.content


@pytest.mark.parametrize("core", [False, True], ids=["replica", "engine-core"])
def test_failure_after_a_streamed_token_ends_with_an_openai_error_event(kit, core):
    app, _ = app_with(kit, llm=FailingTransport(kit.deps.llm, fail=1, after=3, core=core))
    c = kit.client(app=app)

    async def go():
        got = []
        stream = await c.completions.create(model=kit.base, prompt="import os\n", max_tokens=20, temperature=0,
                                            stream=True)
        async for ch in stream:
            got.append(ch.choices[0].text)
        return got

    with pytest.raises(openai.APIError) as e:
        kit.run(go())
    assert "replica" in e.value.message and e.value.code == "replica_failed"
    text = kit.run(scrape(kit, app))
    assert metric(text, "loraserve_replica_failures_total", when="after_first_token") == 1
    assert metric(text, "loraserve_running_requests") == 0


def test_no_replica_left_is_503_openai_json(kit):
    app, _ = app_with(kit, llm=FailingTransport(kit.deps.llm, fail=99), retries=2)
    with pytest.raises(openai.InternalServerError) as e:
        kit.run(kit.client(app=app).completions.create(model=kit.base, prompt="x", max_tokens=2))
    assert e.value.status_code == 503 and e.value.code == "service_unavailable"


class PausingTransport:
    """The real replica; the stream pauses after its first chunk until `go` is set."""

    def __init__(self, inner):
        import asyncio

        self.inner, self.paused, self.go = inner, asyncio.Event(), asyncio.Event()

    async def stream(self, req):
        async for chunk in self.inner.stream(req):
            yield chunk
            if chunk["type"] == "start":
                self.paused.set()
                await self.go.wait()


def test_running_requests_is_exact_and_zero_when_idle(kit):
    import asyncio

    async def go():
        transport = PausingTransport(kit.deps.llm)
        app, _ = app_with(kit, llm=transport)
        gauges = lambda text: (metric(text, "loraserve_running_requests"),  # noqa: E731
                               metric(text, "loraserve_replica_running_requests", replica="kit-replica"))
        request = asyncio.ensure_future(kit.client(app=app).completions.create(model=kit.base, prompt="def ",
                                                                                max_tokens=8))
        await transport.paused.wait()
        during = gauges(await scrape(kit, app))
        transport.go.set()
        await request
        return during, gauges(await scrape(kit, app))

    during, after = kit.run(go())
    assert during == (1.0, 1.0) and after == (0.0, 0.0)


def test_metrics_hide_private_adapters_unless_a_token_is_required(kit):
    open_app, _ = app_with(kit)
    kit.run(kit.client(K.GLOBEX, app=open_app).completions.create(model="globex-secret", prompt="x", max_tokens=2))
    text = kit.run(scrape(kit, open_app))
    assert "globex-secret" not in text and "globex" not in text  # neither the adapter's nor the tenant's name
    assert metric(text, "loraserve_requests_total", adapter="private", tenant="private", status="200") == 1

    closed_app, _ = app_with(kit, metrics_token="metrics-token-123")
    kit.run(kit.client(K.GLOBEX, app=closed_app).completions.create(model="globex-secret", prompt="x", max_tokens=2))

    async def unauthorized():
        async with kit.http(closed_app) as http:
            return await http.get("/metrics")
    r = kit.run(unauthorized())
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    text = kit.run(scrape(kit, closed_app, token="metrics-token-123"))
    assert 'adapter="globex-secret"' in text


def test_rate_limits_are_shared_across_ingress_replicas_through_redis(kit, redis_server):
    def replica():
        local = RateLimiter((0.001, 3), (1000, 1000))
        return app_with(kit, limiter=RedisRateLimiter(redis_server, local, DependencyHealth(), prefix="test-shared"))[0]

    apps = [replica(), replica()]
    codes = []
    for i in range(6):
        try:
            kit.run(kit.client(app=apps[i % 2]).completions.create(model=kit.base, prompt="x", max_tokens=1))
            codes.append(200)
        except openai.RateLimitError as e:
            codes.append(e.status_code)
    assert codes == [200, 200, 200, 429, 429, 429]  # burst 3 for the tenant, whichever replica is asked
    # per-replica buckets (no Redis) would have let 3 through each
    local_apps = [app_with(kit, limiter=RateLimiter((0.001, 3), (1000, 1000)))[0] for _ in range(2)]
    ok = 0
    for i in range(6):
        try:
            kit.run(kit.client(app=local_apps[i % 2]).completions.create(model=kit.base, prompt="x", max_tokens=1))
            ok += 1
        except openai.RateLimitError:
            pass
    assert ok == 6


def test_redis_outage_falls_back_to_local_buckets_with_one_log_line(kit, caplog):
    local = RateLimiter((0.001, 2), (1000, 1000))
    health = DependencyHealth()
    limiter = RedisRateLimiter("redis://127.0.0.1:1/0", local, health)
    app, _ = app_with(kit, limiter=limiter)
    c = kit.client(app=app)
    with caplog.at_level(logging.WARNING, logger="deployments.dependency_health"):
        kit.run(c.completions.create(model=kit.base, prompt="x", max_tokens=1))
        kit.run(c.completions.create(model=kit.base, prompt="x", max_tokens=1))
        with pytest.raises(openai.RateLimitError):
            kit.run(c.completions.create(model=kit.base, prompt="x", max_tokens=1))
    assert health.status() == {"rate-limit Redis": False}
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["rate-limit Redis is unreachable"]


def test_a_client_that_goes_away_aborts_every_choice_in_the_engine(kit):
    """Closing the replica stream mid-generation (what Serve does when the client disconnects) frees the engine."""
    from deployments.data_plane.protocol import GenerateRequest

    async def go():
        req = GenerateRequest("abandoned", None, {"max_tokens": 200, "temperature": 1.0, "top_p": 1.0, "seed": 1,
                                                  "stop": [], "ignore_eos": True}, prompt="def ", n=3)
        stream = kit.server.generate(req)
        async for chunk in stream:
            if chunk["type"] == "delta":
                break
        await stream.aclose()
        for _ in range(100):
            stats = kit.engine.stats()
            if stats["num_running"] == 0 and stats["num_waiting"] == 0:
                return stats
            await asyncio.sleep(0.05)
        return kit.engine.stats()

    stats = kit.run(go())
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["free_kv_blocks"] == stats["total_kv_blocks"]
