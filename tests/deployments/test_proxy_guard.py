"""The prompt guard of Serve's proxy (`deployments.data_plane.proxy_guard`) in front of the real OpenAI app with
fake neighbours: every body answered as the bare app answers it, the long ones without their body crossing. The
guard inside a real Serve proxy is in test_serve_failures_and_limits."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import json

import pytest
from fastapi.testclient import TestClient

from deployments.data_plane.openai_api import IngressDeps, create_openai_app
from deployments.data_plane.protocol import PromptBound
from deployments.data_plane.proxy_guard import (CALLBACK, CALLBACK_ENV, HEADER, GuardLimits, PromptGuard, install,
                                                prompt_fields, proxy_middlewares)
from deployments.data_plane.rate_limit import ColdLoadGate, RateLimiter, RefusalHold
from serving_fakes import Disabled, FakeLLM, FakeResolver, NotFound, Rec

KEY, LIMITED = "sk-guard-tenant-a", "sk-guard-limited"
H = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
BOUND = PromptBound(max_model_len=64, chars_per_token=4)  # 256 characters
MAX_BODY = 64 * 1024


class Spy:
    """Between the guard and the app: the bodies and the guard's header each request arrived with."""

    def __init__(self, app):
        self.app, self.seen = app, []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        chunks = []

        async def recorded():
            message = await receive()
            chunks.append(message.get("body", b""))
            return message

        await self.app(scope, recorded, send)
        self.seen.append((scope["path"], b"".join(chunks), dict(scope["headers"]).get(HEADER)))


def make(guard_bound: PromptBound = BOUND, published: list | None = None, guarded: bool = True):
    llm = FakeLLM(bound=BOUND)
    deps = IngressDeps(base_name="tiny", api_keys={KEY: "a", LIMITED: "limited"}, llm=llm,
                       resolver=FakeResolver({"pub": Rec("pub", 3)}), registry_errors=(NotFound, Disabled),
                       limiter=RateLimiter((100, 100), (100, 100), {"limited": (0.001, 1)}),
                       gate=ColdLoadGate(limit=2, wait_s=0.2), hold=RefusalHold(), max_request_bytes=MAX_BODY,
                       publish_guard_limits=None if published is None else lambda *a: published.append(a))
    spy = Spy(create_openai_app(deps))
    reads = []

    def limits(prefix):
        reads.append(prefix)
        return GuardLimits(guard_bound, MAX_BODY)

    app = PromptGuard(spy, limits=limits) if guarded else spy
    client = TestClient(app, client=("10.0.0.1", 40001))
    assert client.get("/health").status_code == 200
    client.post("/v1/completions", headers=H, json={"model": "tiny", "prompt": "x"})  # the bound asked of the replica
    assert deps.prompt_bound.value == BOUND
    return client, spy, llm, deps, reads


LONG = "y" * (BOUND.max_chars + 1)
AT_BOUND = "y" * BOUND.max_chars
BODIES = [  # (path, body): over the bound, at it, and bodies the schema refuses
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": LONG}]}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "system", "content": AT_BOUND[:200]},
                                                            {"role": "user", "content": AT_BOUND[:57]}]}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "text", "text": AT_BOUND[:200]}, {"type": "text", "text": AT_BOUND[:57]}]}]}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": AT_BOUND}]}),
    ("/v1/completions", {"model": "tiny", "prompt": LONG}),
    ("/v1/completions", {"model": "tiny", "prompt": ["short", LONG]}),
    ("/v1/completions", {"model": "tiny", "prompt": [3] * BOUND.max_model_len}),
    ("/v1/completions", {"model": "tiny", "prompt": [[3] * 4, [3] * BOUND.max_model_len]}),
    ("/v1/completions", {"model": "tiny", "prompt": [3] * (BOUND.max_model_len - 1)}),
    ("/v1/completions", {"model": "tiny", "prompt": AT_BOUND}),
    ("/v1/completions", {"model": "nope", "prompt": LONG}),  # the length is checked before the model
    ("/v1/completions", {"model": "tiny", "prompt": LONG, "temperature": "hot"}),
    ("/v1/completions", {"model": "tiny", "prompt": {"text": LONG}}),
    ("/v1/chat/completions", {"model": "tiny", "messages": {"role": "user", "content": LONG}}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text"}]}, LONG]}),
]


def _answer(r):
    return r.status_code, r.json().get("error", {}).get("code"), r.json().get("error", {}).get("message")


@pytest.mark.parametrize("path,body", BODIES, ids=range(len(BODIES)))
def test_the_guarded_app_answers_every_body_as_the_bare_app_does(path, body):
    raw = json.dumps(body).encode()
    bare, _, _, _, _ = make(guarded=False)
    guarded, spy, llm, _, _ = make()
    want = bare.post(path, content=raw, headers=H)
    got = guarded.post(path, content=raw, headers=H)
    assert _answer(got) == _answer(want)
    _, arrived, marked = spy.seen[-1]
    if marked is not None:  # only a prompt the ingress refuses for its length loses its body
        assert arrived == b"" and want.json()["error"]["code"] == "context_length_exceeded"
    else:
        assert arrived == raw


def test_a_long_prompt_crosses_without_its_body_and_counts_as_a_refusal():
    client, spy, llm, deps, reads = make()
    seen = len(llm.seen)
    r = client.post("/v1/chat/completions", headers=H,
                    json={"model": "tiny", "messages": [{"role": "user", "content": "z" * 5000}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert r.json()["error"]["param"] == "messages" and "5000 characters" in r.json()["error"]["message"]
    assert spy.seen[-1] == ("/v1/chat/completions", b"", b"chars 5000")
    assert len(llm.seen) == seen
    assert deps.hold._window["a@10.0.0.1"][1] == 1  # towards benching its caller
    assert "loraserve_prompts_refused_in_proxy_total 1.0" in client.get("/metrics").text
    assert reads == [""]  # read once (the guard keeps them `refresh_s`), for the app at the root


def test_the_caller_is_known_before_a_long_prompt_is_refused():
    client, spy, _, _, _ = make()
    body = json.dumps({"model": "tiny", "prompt": LONG}).encode()
    for headers, body_read in [({}, False), ({"Authorization": "Bearer sk-wrong"}, True)]:
        r = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json", **headers})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        assert spy.seen[-1][2] == (b"chars %d" % len(LONG) if body_read else None)  # no key: not read
    limited = {"Authorization": f"Bearer {LIMITED}", "Content-Type": "application/json"}
    codes = [client.post("/v1/completions", content=body, headers=limited).status_code for _ in range(3)]
    assert codes[0] == 400 and codes[1:] == [429, 429]


def test_a_clients_own_header_decides_nothing():
    client, spy, _, _, _ = make()
    forged = {**H, HEADER.decode(): "chars 99999999"}
    r = client.post("/v1/completions", headers=forged, json={"model": "tiny", "prompt": "a b"})
    assert r.status_code == 200, r.text  # the guard dropped it
    assert spy.seen[-1][2] is None
    bare, spy, _, _, _ = make(guarded=False)  # no guard: the ingress ignores it beside a body it was sent
    r = bare.post("/v1/completions", headers={**H, HEADER.decode(): "chars 3"}, json={"model": "tiny", "prompt": "a b"})
    assert r.status_code == 200, r.text


def test_a_body_dropped_on_a_stale_bound_is_a_503_to_retry():
    client, spy, _, _, _ = make(guard_bound=PromptBound(max_model_len=16, chars_per_token=4))
    r = client.post("/v1/completions", headers=H, json={"model": "tiny", "prompt": "y" * 100})
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert spy.seen[-1][1:] == (b"", b"chars 100")


def test_what_the_guard_lets_through_untouched():
    client, spy, _, _, reads = make()
    over = json.dumps({"model": "tiny", "prompt": "y" * (MAX_BODY + 10)}).encode()
    r = client.post("/v1/completions", content=over, headers=H)
    assert r.status_code == 413  # over the body limit: the ingress refuses it unread
    broken = b'{"model": "tiny", "prompt": "' + b"y" * 1000
    r = client.post("/v1/completions", content=broken, headers=H)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    assert spy.seen[-1][1:] == (broken, None)
    r = client.post("/v1/models", headers=H, content=json.dumps({"prompt": LONG}))
    assert r.status_code == 405 and spy.seen[-1][2] is None


def test_the_ingress_publishes_its_limits_once_its_bound_is_known():
    published = []
    client, _, _, _, _ = make(published=published)
    client.get("/health")
    assert published == [("", GuardLimits(BOUND, MAX_BODY))]


def test_limits_round_trip_and_which_bodies_are_read():
    limits = GuardLimits(BOUND, MAX_BODY)
    assert GuardLimits.from_json(limits.to_json()) == limits
    assert not limits.guards(BOUND.max_chars) and limits.guards(BOUND.max_chars + 1)
    assert limits.guards(MAX_BODY) and not limits.guards(MAX_BODY + 1)
    assert prompt_fields({"prompt": [True, 1]}, chat=False) is None
    assert prompt_fields([], chat=True) is None


def test_the_proxy_callback_is_named_unless_another_is():
    env = {}
    assert install(env) and env == {CALLBACK_ENV: CALLBACK}
    assert not install({CALLBACK_ENV: "theirs:callback"})
    module, _, name = CALLBACK.partition(":")
    callback = getattr(__import__(module, fromlist=[name]), name)
    assert callback is proxy_middlewares and [m.cls for m in callback()] == [PromptGuard]
    from ray.serve._private.http_util import validate_http_proxy_callback_return

    assert validate_http_proxy_callback_return(callback())  # what Serve's proxy accepts
