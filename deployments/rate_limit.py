"""Token-bucket rate limits per tenant and per adapter, and the cold-load concurrency gate.

`RateLimiter` keeps its buckets in the ingress replica: with N ingress replicas a tenant may get
up to N times its rate. `RedisRateLimiter` keeps them in Redis (one atomic script per request,
Redis's clock), so every ingress replica draws from the same buckets; it is used when Redis is
configured, and falls back to the local buckets while Redis is unreachable. The local clock is
injected so tests need no sleeps.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

__all__ = ["TokenBucket", "RateLimiter", "RedisRateLimiter", "RateLimited", "ColdLoadGate"]

logger = logging.getLogger(__name__)


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
    """`check(tenant, adapter)` takes one token from both buckets, or none and raises."""

    tenant_default: tuple[float, float]  # (rate, burst)
    adapter_default: tuple[float, float]
    tenant_overrides: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    adapter_overrides: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    clock: Callable[[], float] = time.monotonic
    _buckets: dict[tuple[str, str], TokenBucket] = field(default_factory=dict)

    def _bucket(self, scope: str, key: str, now: float) -> TokenBucket:
        b = self._buckets.get((scope, key))
        if b is None:
            default, overrides = (
                (self.tenant_default, self.tenant_overrides)
                if scope == "tenant"
                else (self.adapter_default, self.adapter_overrides)
            )
            rate, burst = overrides.get(key, default)
            b = self._buckets[(scope, key)] = TokenBucket(rate, burst, stamp=now)
        return b

    def check(self, tenant: str, adapter: Optional[str]) -> None:
        now = self.clock()
        buckets = [("tenant", tenant, self._bucket("tenant", tenant, now))]
        if adapter:
            buckets.append(("adapter", adapter, self._bucket("adapter", adapter, now)))
        for scope, key, bucket in buckets:  # all or nothing: a refusal charges no bucket
            if not bucket.can_take(now):
                raise RateLimited(scope, key, bucket.wait_time(now))
        for _, _, bucket in buckets:
            bucket.take(now)

    @staticmethod
    def retry_after_header(err: RateLimited) -> str:
        return str(max(1, math.ceil(err.retry_after_s)))


# KEYS: bucket keys; ARGV: rate_1, burst_1, rate_2, burst_2, ...  Returns {0, ""} when a token was taken from
# every bucket, else {i, wait_s} for the first bucket i (1-based) without one, charging none (all or nothing).
_TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local state = {}
for i = 1, #KEYS do
  local rate, burst = tonumber(ARGV[2 * i - 1]), tonumber(ARGV[2 * i])
  local v = redis.call('HMGET', KEYS[i], 'tokens', 'stamp')
  local tokens, stamp = tonumber(v[1]) or burst, tonumber(v[2]) or now
  if now > stamp then
    tokens = math.min(burst, tokens + (now - stamp) * rate)
    stamp = now
  end
  if tokens < 1 then
    return {i, tostring((1 - tokens) / rate)}
  end
  state[i] = {tokens - 1, stamp, math.ceil(burst / rate * 1000) + 1000}
end
for i = 1, #KEYS do
  redis.call('HSET', KEYS[i], 'tokens', tostring(state[i][1]), 'stamp', tostring(state[i][2]))
  redis.call('PEXPIRE', KEYS[i], state[i][3])
end
return {0, ''}
"""


class RedisRateLimiter:
    """`RateLimiter`'s contract with the buckets in Redis, shared by every ingress replica."""

    def __init__(self, url: str, local: RateLimiter, prefix: str = "loraserve:ratelimit"):
        import redis

        self.local, self.prefix = local, prefix
        self._redis = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
        self._take = self._redis.register_script(_TAKE)
        self._errors = (redis.RedisError, OSError)

    def check(self, tenant: str, adapter: Optional[str]) -> None:
        scopes = [("tenant", tenant)] + ([("adapter", adapter)] if adapter else [])
        args: list[float] = []
        for scope, key in scopes:
            defaults, overrides = ((self.local.tenant_default, self.local.tenant_overrides) if scope == "tenant"
                                   else (self.local.adapter_default, self.local.adapter_overrides))
            args += list(overrides.get(key, defaults))
        try:
            failed, wait = self._take(keys=[f"{self.prefix}:{s}:{k}" for s, k in scopes], args=args)
        except self._errors:
            logger.warning("rate limits: Redis unreachable, using this replica's buckets", exc_info=True)
            return self.local.check(tenant, adapter)
        if int(failed):
            scope, key = scopes[int(failed) - 1]
            raise RateLimited(scope, key, float(wait))

    @staticmethod
    def retry_after_header(err: RateLimited) -> str:
        return RateLimiter.retry_after_header(err)


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
