"""Prompts too long for the context refused in Serve's HTTP proxy, before their bodies cross to the ingress.

The ingress refuses a prompt whose length alone shows it cannot fit (`PromptBound`, no tokenizer), but by the
time it runs Serve has already moved the body from the proxy to the ingress replica: for a 1.9 MB prompt about
12 ms of the ingress's CPU, most of it Ray's, and the proxy's pickling on top, taken from the cores the replicas
decode on. Two halves:

- `PromptGuard`, in the proxy (Serve's HTTP proxy callback: `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH` set to
  `CALLBACK`, which `install` does for a cluster this process starts). For a POST to a generation route with a
  bearer key whose Content-Length is above its app's character bound (a prompt of N characters takes at least N
  bytes) and within its body limit, it reads the body, and when the prompt cannot fit (`PromptBound.excess`, the same
  count the ingress makes) forwards the request without its body and with `x-loraserve-prompt-over: UNIT COUNT`.
  Every other request passes untouched, and a client's own `x-loraserve-prompt-over` header is dropped.
- `GuardedRefusals`, in the ingress app behind the front door: so the caller is identified, benched and charged
  from its headers first (401, 429) as for any request; then such a request gets the ingress's own 400
  `context_length_exceeded`, counted towards benching its caller. The ingress publishes each app's limits
  (`publish`: Ray's internal KV, per route prefix) once its replicas' bound is known; the guard reads them at
  most every `refresh_s`.

The header decides nothing on its own: a request carrying one is refused only when the ingress's own bound
refuses that count, so a client forging it (where no guard runs) can only have its own request refused.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, MutableMapping, Optional

from pydantic import ValidationError

from deployments.data_plane.errors import APIError
from deployments.data_plane.front_door import route_path
from deployments.data_plane.openai_routes import context_length_error, prompt_inputs
from deployments.data_plane.openai_schema import ChatCompletionRequest, CompletionRequest
from deployments.data_plane.protocol import CHARS, TOKENS, PromptBound

__all__ = ["CALLBACK", "CALLBACK_ENV", "HEADER", "GuardLimits", "GuardedRefusals", "PromptGuard", "install",
           "prompt_fields", "proxy_middlewares", "publish", "read_published"]

logger = logging.getLogger(__name__)

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"  # read by Serve's proxies when they start
CALLBACK = "deployments.data_plane.proxy_guard:proxy_middlewares"
HEADER = b"x-loraserve-prompt-over"
ROUTES = {"/v1/chat/completions": True, "/v1/completions": False}  # path under the app -> a chat route
KV_NAMESPACE, KV_PREFIX = "loraserve", "prompt-guard:"


@dataclass(frozen=True)
class GuardLimits:
    """What the guard needs of one app: its replicas' prompt bound and its body limit."""

    bound: PromptBound
    max_body: int

    def to_json(self) -> bytes:
        return json.dumps({"max_model_len": self.bound.max_model_len, "chars_per_token": self.bound.chars_per_token,
                           "max_body": self.max_body}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "GuardLimits":
        d = json.loads(raw)
        return cls(PromptBound(int(d["max_model_len"]), int(d["chars_per_token"])), int(d["max_body"]))

    def guards(self, content_length: int) -> bool:
        """Whether a body of this many bytes could hold a prompt over the bound (and is one the app would read)."""
        return self.bound.max_chars < content_length <= self.max_body


def install(env: MutableMapping[str, str]) -> bool:
    """Name the guard as Serve's proxy callback in `env` (the environment a Ray cluster started from this process
    inherits), unless another callback is named there. -> whether the guard is the one named."""
    return env.setdefault(CALLBACK_ENV, CALLBACK) == CALLBACK


def proxy_middlewares() -> list:
    """Serve's HTTP proxy callback: the middlewares each proxy wraps its app in."""
    from starlette.middleware import Middleware

    return [Middleware(PromptGuard)]


# ---------------------------------------------------------------------------------------------- the limits
def _key(prefix: str) -> str:
    return KV_PREFIX + prefix.rstrip("/")


def publish(prefix: str, limits: GuardLimits) -> None:
    """The limits of the app under route prefix `prefix`, for every proxy of the cluster (blocking: a GCS call)."""
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(_key(prefix), limits.to_json(), overwrite=True, namespace=KV_NAMESPACE)


def read_published(prefix: str) -> Optional[GuardLimits]:
    """The limits published for route prefix `prefix`, or None (blocking: a GCS call)."""
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_initialized

    if not _internal_kv_initialized():
        return None
    raw = _internal_kv_get(_key(prefix), namespace=KV_NAMESPACE)
    return None if raw is None else GuardLimits.from_json(raw)


# ---------------------------------------------------------------------------------------------- the prompt
def prompt_fields(body: Any, chat: bool) -> Optional[dict[str, Any]]:
    """The prompt fields (GenerateRequest's names) of a parsed JSON body, validated by the schema the ingress's
    route validates it with, or None when that schema refuses it (the ingress then answers it)."""
    try:
        parsed = (ChatCompletionRequest if chat else CompletionRequest).model_validate(body)
    except ValidationError:
        return None
    return prompt_inputs(parsed, chat)


# ---------------------------------------------------------------------------------------------- in the proxy
class PromptGuard:
    """ASGI middleware in Serve's proxy (module docstring). `limits(prefix) -> GuardLimits | None` reads an app's
    published limits (blocking; called from a worker thread, at most every `refresh_s` a prefix, every second
    while none are published)."""

    def __init__(self, app, limits: Callable[[str], Optional[GuardLimits]] = read_published,
                 refresh_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self.app, self._read, self.refresh_s, self.clock = app, limits, refresh_s, clock
        self._known: dict[str, tuple[float, Optional[GuardLimits]]] = {}  # prefix -> (read at, limits)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = scope.get("headers") or []
        if any(k == HEADER for k, _ in headers):
            scope = {**scope, "headers": [(k, v) for k, v in headers if k != HEADER]}
        route = self._route(scope)
        if route is None:
            return await self.app(scope, receive, send)
        prefix, chat = route
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"")
        if not declared.isdigit() or not headers.get(b"authorization", b"").lower().startswith(b"bearer "):
            return await self.app(scope, receive, send)  # no key: the ingress answers 401 from the headers
        limits = await self._limits(prefix)
        if limits is None or not limits.guards(int(declared)):
            return await self.app(scope, receive, send)
        body, closed = await _read_body(receive)
        if closed:  # the client went away while sending
            return
        over = _excess(body, chat, limits.bound)
        if over is None:
            return await self.app(scope, _replay(body, receive), send)
        unit, count = over
        kept = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
        scope = {**scope, "headers": kept + [(b"content-length", b"0"), (HEADER, f"{unit} {count}".encode())]}
        await self.app(scope, _replay(b"", receive), send)

    @staticmethod
    def _route(scope) -> Optional[tuple[str, bool]]:
        """(route prefix, chat) of a POST to a generation route, else None."""
        if scope.get("method") != "POST":
            return None
        path = scope.get("path", "")
        for suffix, chat in ROUTES.items():
            if path.endswith(suffix):
                return path[:-len(suffix)].rstrip("/"), chat
        return None

    async def _limits(self, prefix: str) -> Optional[GuardLimits]:
        at, limits = self._known.get(prefix, (None, None))
        ttl = self.refresh_s if limits is not None else min(1.0, self.refresh_s)  # an app just started publishes soon
        if at is None or self.clock() - at >= ttl:
            try:
                limits = await asyncio.to_thread(self._read, prefix)
            except Exception as e:  # noqa: BLE001 - the guard is an optimisation: the ingress checks every prompt
                logger.warning("reading the prompt guard's limits for %r failed: %s", prefix, e)
            self._known[prefix] = (self.clock(), limits)
        return limits


async def _read_body(receive) -> tuple[bytes, bool]:
    """The whole body, and whether the client disconnected instead."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"", True
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks), False


def _replay(body: bytes, receive):
    """A receive that gives `body` as one message, then what `receive` gives (the disconnect)."""
    sent = False

    async def replayed():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


def _excess(body: bytes, chat: bool, bound: PromptBound) -> Optional[tuple[str, int]]:
    try:
        fields = prompt_fields(json.loads(body), chat)
    except ValueError:  # not JSON (or not UTF-8): the ingress answers it
        return None
    return None if fields is None else bound.excess(**fields)


# ---------------------------------------------------------------------------------------------- in the ingress
class GuardedRefusals:
    """ASGI middleware of the ingress app, behind the front door: a request the proxy's guard marked gets the
    ingress's own length refusal (`answer(err)`, counted towards benching its caller by `refused(scope)`); the
    limits are published (`publish(prefix, limits)`, called in a worker thread) for each route prefix the app is
    reached under, once `bound()` is known."""

    def __init__(self, app, bound: Callable[[], Optional[PromptBound]], max_body: int,
                 answer: Callable[[APIError], Any], refused: Callable[[Any], None],
                 publish: Optional[Callable[[str, GuardLimits], None]] = None):
        self.app, self.bound, self.max_body, self.answer, self.refused = app, bound, max_body, answer, refused
        self.publish = publish
        self._published: set[str] = set()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        bound = self.bound()
        if bound is not None and self.publish is not None:
            self._publish(scope.get("root_path", ""), bound)
        chat = ROUTES.get(route_path(scope)) if scope.get("method") == "POST" else None
        headers = dict(scope.get("headers") or ()) if chat is not None else {}
        marked = headers.get(HEADER)
        if marked is None:
            return await self.app(scope, receive, send)
        unit, _, count = marked.decode("latin-1").partition(" ")
        why = bound.refusal_for(unit, int(count)) if bound is not None and unit in (CHARS, TOKENS) \
            and count.isdigit() else None
        if why is not None:
            self.refused(scope)
            err = context_length_error(why, chat)
        elif headers.get(b"content-length") == b"0":  # the guard dropped the body on limits this ingress no longer has
            err = APIError(503, "the request's body was dropped on a stale prompt bound; send it again",
                           code="service_unavailable", headers={"Retry-After": "1"})
        else:  # a client's own header on a body it sent: decides nothing
            return await self.app(scope, receive, send)
        await self.answer(err)(scope, receive, send)

    def _publish(self, prefix: str, bound: PromptBound) -> None:
        prefix = prefix.rstrip("/")
        if prefix in self._published:
            return
        self._published.add(prefix)

        def put() -> None:
            try:
                self.publish(prefix, GuardLimits(bound, self.max_body))
            except Exception as e:  # noqa: BLE001 - without it the ingress refuses long prompts itself
                self._published.discard(prefix)
                logger.warning("publishing the prompt guard's limits for %r failed: %s", prefix, e)

        asyncio.get_running_loop().run_in_executor(None, put)
