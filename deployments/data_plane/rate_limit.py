"""Token-bucket rate limits per tenant and per adapter, and the cold-load concurrency gate.

A request takes one token from its tenant's bucket once its API key is known, before its body is read (so
a malformed request costs its caller like any other), and one from its adapter's bucket once its model is
resolved. `RateLimiter` keeps its buckets in the ingress replica: with N ingress replicas a tenant may get
up to N times its rate. `RedisRateLimiter` keeps them in Redis (one atomic script per take, Redis's clock), so
every ingress replica draws from the same buckets; while Redis is unreachable it uses the local buckets, and
tries Redis again only every `DependencyHealth.retry_s` (one log line per outage). The local clock is
injected so tests need no sleeps.

`RefusalHold` benches a caller that keeps sending requests that are refused: a closed-loop flood (the next request
sent as soon as the last answer comes) would otherwise send as fast as refusals come back, and every refusal still
costs the proxy and the ingress a few milliseconds of CPU (a malformed body its parse too) that other tenants'
requests wait behind.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

from deployments.dependency_health import DependencyHealth
from deployments.data_plane.errors import retry_after

__all__ = ["TokenBucket", "RateLimiter", "RedisRateLimiter", "RateLimited", "RefusalHold", "ColdLoadGate"]



class RateLimited(Exception):
    def __init__(self, scope: str, key: str, retry_after_s: float):
        super().__init__(f"rate limit exceeded for {scope} {key!r}; retry after {retry_after_s:.2f}s")
        self.scope, self.key, self.retry_after_s = scope, key, retry_after_s


@dataclass
class TokenBucket:
    rate: float  # tokens per second
    burst: float  # capacity
    tokens: float = -1.0  # -1: start full
    stamp: float = 0.0

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.burst < 1:
            raise ValueError("rate must be > 0 and burst >= 1")
        if self.tokens < 0:
            self.tokens = self.burst

    def _refill(self, now: float) -> None:
        if now > self.stamp:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now

    def can_take(self, now: float, cost: float = 1.0) -> bool:
        self._refill(now)
        return self.tokens >= cost

    def take(self, now: float, cost: float = 1.0) -> None:
        self._refill(now)
        self.tokens -= cost

    def wait_time(self, now: float, cost: float = 1.0) -> float:
        self._refill(now)
        return max(0.0, (cost - self.tokens) / self.rate)


@dataclass
class RateLimiter:
    """`take(scope, key)` takes one token from the bucket of `key` in `scope` ("tenant" or "adapter"), or raises
    RateLimited and takes none."""

    blocking = False  # take() never waits on I/O: the ingress calls it on its event loop
    tenant_default: tuple[float, float]  # (rate, burst)
    adapter_default: tuple[float, float]
    tenant_overrides: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    adapter_overrides: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    clock: Callable[[], float] = time.monotonic
    _buckets: dict[tuple[str, str], TokenBucket] = field(default_factory=dict)

    def spec(self, scope: str, key: str) -> tuple[float, float]:
        """(rate, burst) of the bucket of `key` in `scope`."""
        default, overrides = ((self.tenant_default, self.tenant_overrides) if scope == "tenant"
                              else (self.adapter_default, self.adapter_overrides))
        return overrides.get(key, default)

    def take(self, scope: str, key: str) -> None:
        now = self.clock()
        bucket = self._buckets.get((scope, key))
        if bucket is None:
            bucket = self._buckets[(scope, key)] = TokenBucket(*self.spec(scope, key), stamp=now)
        if not bucket.can_take(now):  # a refusal takes nothing
            raise RateLimited(scope, key, bucket.wait_time(now))
        bucket.take(now)

    @staticmethod
    def retry_after_header(err: RateLimited) -> str:
        return retry_after(err.retry_after_s)


# KEYS: the bucket's key; ARGV: rate, burst. Returns "" when a token was taken, else the seconds to wait.
_TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local v = redis.call('HMGET', KEYS[1], 'tokens', 'stamp')
local tokens, stamp = tonumber(v[1]) or burst, tonumber(v[2]) or now
if now > stamp then
  tokens = math.min(burst, tokens + (now - stamp) * rate)
  stamp = now
end
if tokens < 1 then
  return tostring((1 - tokens) / rate)
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens - 1), 'stamp', tostring(stamp))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return ''
"""
RATE_LIMIT_REDIS = "rate-limit Redis"


class RedisRateLimiter:
    """`RateLimiter`'s contract with the buckets in Redis, shared by every ingress replica."""

    blocking = True  # take() is a Redis round trip: the ingress calls it from a worker thread

    def __init__(self, url: str, local: RateLimiter, health: DependencyHealth, prefix: str = "loraserve:ratelimit"):
        import redis

        self.local, self.health, self.prefix = local, health, prefix
        self._redis = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
        self._take = self._redis.register_script(_TAKE)
        self._errors = (redis.ConnectionError, redis.TimeoutError, OSError)

    def take(self, scope: str, key: str) -> None:
        if not self.health.should_try(RATE_LIMIT_REDIS):
            return self.local.take(scope, key)
        try:
            wait = self._take(keys=[f"{self.prefix}:{scope}:{key}"], args=list(self.local.spec(scope, key)))
        except self._errors as e:
            self.health.failed(RATE_LIMIT_REDIS, e)
            return self.local.take(scope, key)
        self.health.ok(RATE_LIMIT_REDIS)
        if wait:
            raise RateLimited(scope, key, float(wait))

    @staticmethod
    def retry_after_header(err: RateLimited) -> str:
        return RateLimiter.retry_after_header(err)


MAX_TRACKED_CALLERS = 10_000  # refusal counts kept before the idle ones are dropped


@dataclass
class RefusalHold:
    """A caller refused more than `after` times within one second (any 4xx answer to its own requests: malformed,
    an unknown model, over its rate) is benched: while it keeps sending, each of its requests is refused with a 429
    before its body is read or its rate limit taken, the answer held `hold_s`, and the bench lasts until `hold_s`
    after its last request. At most `max_held` answers are held at a time per ingress replica (past that they are
    answered at once, so held answers never take the ingress's room from other callers). A caller that waits out
    its 429's Retry-After (at least `hold_s`) is served again; a closed-loop flood sends about its concurrency per
    `hold_s`, every request refused before anything costly. `hold_s` 0: never benched."""

    hold_s: float = 1.0
    after: int = 20
    max_held: int = 64
    clock: Callable[[], float] = time.monotonic
    held: int = 0  # answers being held now
    _window: dict[str, tuple[float, int]] = field(default_factory=dict)  # caller -> (window start, refusals)
    _until: dict[str, float] = field(default_factory=dict)  # benched caller -> end of its bench

    def refused(self, caller: str) -> None:
        """Count one refusal of `caller`'s request; the one past `after` within a second benches it."""
        now = self.clock()
        if len(self._window) >= MAX_TRACKED_CALLERS:
            self._forget_idle(now)
        start, count = self._window.get(caller, (now, 0))
        if now - start >= 1.0:
            start, count = now, 0
        self._window[caller] = (start, count + 1)
        if self.hold_s > 0 and count + 1 > self.after:
            self._until[caller] = max(self._until.get(caller, now), now + self.hold_s)

    def _forget_idle(self, now: float) -> None:
        """Drop callers whose counting second and bench are over: a caller is a tenant and a client host, and the
        hosts are the clients' to choose."""
        self._window = {c: w for c, w in self._window.items() if now - w[0] < 1.0}
        self._until = {c: t for c, t in self._until.items() if t > now}

    def benched(self, caller: str) -> bool:
        """Whether `caller` is benched now; a request while it is extends the bench to `hold_s` from now."""
        now = self.clock()
        until = self._until.get(caller)
        if until is None or until <= now:
            self._until.pop(caller, None)
            return False
        self._until[caller] = max(until, now + self.hold_s)
        return True

    def retry_after_s(self, caller: str) -> float:
        """Seconds left of `caller`'s bench, and never under `hold_s` (the bench a retry sooner would meet)."""
        return max(self.hold_s, self._until.get(caller, 0.0) - self.clock())

    async def hold(self) -> bool:
        """Hold one answer `hold_s` unless `max_held` are held already. -> whether it was held."""
        if self.hold_s <= 0 or self.held >= self.max_held:
            return False
        self.held += 1
        try:
            await asyncio.sleep(self.hold_s)
        finally:
            self.held -= 1
        return True


@dataclass
class ColdLoadGate:
    """At most `limit` in-flight requests per adapter until a replica reports it loaded.

    Without it, a burst for a new adapter saturates its home replica, spills, and every
    replica loads the adapter at once (a cold-load storm). Warmth expires after
    `warm_ttl_s` without a successful response, since the adapter may be evicted by then.
    """

    limit: int = 2
    wait_s: float = 30.0
    warm_ttl_s: float = 300.0
    clock: Callable[[], float] = time.monotonic
    _warm_until: dict[str, float] = field(default_factory=dict)
    _sems: dict[str, asyncio.Semaphore] = field(default_factory=dict)

    def is_warm(self, adapter: str) -> bool:
        return self._warm_until.get(adapter, -math.inf) > self.clock()

    def mark_warm(self, adapter: str) -> None:
        self._warm_until[adapter] = self.clock() + self.warm_ttl_s

    def forget(self, adapter: str) -> None:
        self._warm_until.pop(adapter, None)

    def in_flight(self, adapter: str) -> int:
        sem = self._sems.get(adapter)
        return 0 if sem is None else self.limit - sem._value  # noqa: SLF001 (asyncio has no getter)

    async def acquire(self, adapter: str) -> bool:
        """Returns whether a slot was taken (release it); raises TimeoutError when none frees up."""
        if self.is_warm(adapter):
            return False
        sem = self._sems.setdefault(adapter, asyncio.Semaphore(self.limit))
        await asyncio.wait_for(sem.acquire(), timeout=self.wait_s)
        return True

    def release(self, adapter: str) -> None:
        sem = self._sems.get(adapter)
        if sem is not None:
            sem.release()
