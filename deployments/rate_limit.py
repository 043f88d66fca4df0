"""Token-bucket rate limits per tenant and per adapter, and the cold-load concurrency gate.

Limits are per ingress replica (no shared state on the hot path): with N ingress replicas
a tenant may get up to N times its rate. The clock is injected so tests need no sleeps.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

__all__ = ["TokenBucket", "RateLimiter", "RateLimited", "ColdLoadGate"]


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
