"""The data plane's front door: every tenant route's caller identified, benched and charged from its headers
alone, before a byte of its body is read or parsed.

`FrontDoor` is an ASGI middleware in front of the OpenAI routes (`/v1/...`). Per request, in this order:
API key (none or unknown -> 401) -> the caller's bench (`RefusalHold`: a caller refused over and over -> 429,
its answer held) -> the tenant's rate limit (-> 429). Only then does the app read the body (within the body
limit) and parse it, so a malformed body costs its tenant a token like any other request, and its 400 counts
towards benching its caller.

A caller is the tenant of the API key together with the client address the ingress sees (the host of the
connection, without its port): one broken client on a key is benched, and the key's other clients, which send
requests that are not refused, keep being served within the tenant's rate limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from deployments.data_plane.errors import APIError, retry_after
from deployments.data_plane.rate_limit import RateLimited, RateLimiter, RefusalHold

__all__ = ["FrontDoor", "Caller", "tenant_of", "caller_of", "tenant_let_in", "route_path"]

GUARDED_PREFIX = "/v1/"  # the tenant routes; /health, /ready, /metrics, /docs and the control plane are not


@dataclass(frozen=True)
class Caller:
    tenant: str
    address: str  # the client's host as the ingress sees it ("-" when the server gives none)

    def __str__(self) -> str:
        return f"{self.tenant}@{self.address}"


def tenant_of(api_keys: Mapping[str, str], authorization: str) -> str:
    """The tenant of a `Bearer KEY` header, or a 401."""
    scheme, _, key = authorization.partition(" ")
    tenant = api_keys.get(key.strip()) if scheme.lower() == "bearer" else None
    if tenant is None:
        raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer YOUR_KEY'.",
                       code="invalid_api_key")
    return tenant


def caller_of(scope) -> Optional[Caller]:
    """The caller the front door let in (None on routes it does not guard)."""
    return scope.get("state", {}).get("caller")


def tenant_let_in(scope) -> str:
    """The tenant of the caller the front door let in; a 401 where none was (a route it does not guard)."""
    caller = caller_of(scope)
    if caller is None:
        raise APIError(401, "Incorrect or missing API key.", code="invalid_api_key")
    return caller.tenant


def route_path(scope) -> str:
    """The path under the app's mount point (Serve's route_prefix arrives as root_path, and in path too)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class FrontDoor:
    """ASGI middleware: `answer(err) -> Response` renders a refusal (and counts it); `count_limited(scope)` counts
    a 429 by what limited it (metrics)."""

    def __init__(self, app, api_keys: Mapping[str, str], limiter, hold: RefusalHold,
                 answer: Callable[[APIError], Response], count_limited: Callable[[str], None],
                 count_held: Callable[[], None]):
        self.app, self.api_keys, self.limiter, self.hold = app, api_keys, limiter, hold
        self.answer, self.count_limited, self.count_held = answer, count_limited, count_held

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not route_path(scope).startswith(GUARDED_PREFIX):
            return await self.app(scope, receive, send)
        try:
            caller = await self._admit(scope)
        except APIError as err:
            return await self.answer(err)(scope, receive, send)
        scope.setdefault("state", {})["caller"] = caller
        await self.app(scope, receive, send)

    async def _admit(self, scope) -> Caller:
        headers = dict(scope.get("headers") or ())
        tenant = tenant_of(self.api_keys, headers.get(b"authorization", b"").decode("latin-1"))
        client = scope.get("client")
        caller = Caller(tenant, client[0] if client else "-")
        try:
            await self._unbenched(caller)
            await self._take("tenant", tenant)
        except APIError:
            self.hold.refused(str(caller))  # a 429 is a refusal too: a flood past its rate gets benched
            raise
        return caller

    async def _unbenched(self, caller: Caller) -> None:
        """A 429 for a benched caller (RefusalHold), its answer held first, else nothing."""
        key = str(caller)
        if not self.hold.benched(key):
            return
        self.count_limited("refusals")
        if await self.hold.hold():
            self.count_held()
        wait = self.hold.retry_after_s(key)
        raise APIError(429, f"too many refused requests from this client of tenant {caller.tenant!r}; retry after "
                       f"{wait:.2f}s", code="rate_limit_exceeded", headers={"Retry-After": retry_after(wait)})

    async def _take(self, scope: str, key: str) -> None:
        await take(self.limiter, scope, key, self.count_limited)


async def take(limiter, scope: str, key: str, count_limited: Callable[[str], None]) -> None:
    """One token of `key`'s bucket in `scope`, or a 429 (a limiter that waits on I/O runs in a worker thread)."""
    try:
        if limiter.blocking:
            await run_in_threadpool(limiter.take, scope, key)
        else:
            limiter.take(scope, key)
    except RateLimited as e:
        count_limited(e.scope)
        raise APIError(429, str(e), code="rate_limit_exceeded",
                       headers={"Retry-After": RateLimiter.retry_after_header(e)}) from None

