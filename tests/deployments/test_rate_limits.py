import asyncio

import pytest

from deployments.data_plane.rate_limit import ColdLoadGate, RateLimited, RateLimiter, TokenBucket


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_token_bucket_refills_at_rate_up_to_burst():
    b = TokenBucket(rate=2.0, burst=3, stamp=0.0)
    for _ in range(3):
        assert b.can_take(0.0)
        b.take(0.0)
    assert not b.can_take(0.0)
    assert b.wait_time(0.0) == pytest.approx(0.5)
    assert b.can_take(0.5)
    b.take(0.5)
    assert b.can_take(100.0) and b.tokens == 3  # capped at burst
    with pytest.raises(ValueError):
        TokenBucket(rate=0, burst=1)


def test_limiter_refusal_takes_nothing_and_scopes_are_apart():
    clock = Clock()
    lim = RateLimiter((10, 5), (1, 1), clock=clock)
    lim.take("adapter", "a")
    with pytest.raises(RateLimited) as e:
        lim.take("adapter", "a")
    assert e.value.scope == "adapter" and e.value.retry_after_s == pytest.approx(1.0)
    assert RateLimiter.retry_after_header(e.value) == "1"
    for _ in range(5):  # the tenant's bucket of the same name is another bucket
        lim.take("tenant", "a")
    with pytest.raises(RateLimited) as e:
        lim.take("tenant", "a")
    assert e.value.scope == "tenant"
    clock.t += 0.1  # one token back: the refusals above took none
    lim.take("tenant", "a")
    with pytest.raises(RateLimited):
        lim.take("tenant", "a")
    clock.t += 1.0
    lim.take("adapter", "a")


def test_limiter_overrides():
    clock = Clock()
    lim = RateLimiter((1, 1), (1, 1), tenant_overrides={"big": (100, 100)}, clock=clock)
    for _ in range(50):
        lim.take("tenant", "big")
    lim.take("tenant", "small")
    with pytest.raises(RateLimited):
        lim.take("tenant", "small")


def test_cold_gate_caps_in_flight_until_warm():
    async def scenario():
        clock = Clock()
        gate = ColdLoadGate(limit=2, wait_s=0.05, clock=clock)
        assert await gate.acquire("a@1") and await gate.acquire("a@1")
        assert gate.in_flight("a@1") == 2
        with pytest.raises(asyncio.TimeoutError):
            await gate.acquire("a@1")
        assert await gate.acquire("b@1")  # per adapter
        gate.release("a@1")
        assert await gate.acquire("a@1")
        gate.mark_warm("a@1")
        assert await gate.acquire("a@1") is False  # warm: no cap, nothing to release
        clock.t += gate.warm_ttl_s + 1
        assert not gate.is_warm("a@1")

    asyncio.run(scenario())
