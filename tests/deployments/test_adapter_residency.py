import asyncio

import pytest

from deployments.adapter_cache import AdapterBlocked, AdapterCache, adapter_key, split_key


class Engine:
    def __init__(self, delay=0.0, fail=()):
        self.known, self.loads, self.removed, self.delay, self.fail = set(), [], [], delay, set(fail)

    async def load(self, key):
        self.loads.append(key)
        await asyncio.sleep(self.delay)
        if key in self.fail:
            raise ValueError(f"bad adapter {key}")
        self.known.add(key)

    def unload(self, key):
        self.removed.append(key)
        self.known.discard(key)


def run(coro):
    return asyncio.run(coro)


def test_keys():
    assert adapter_key("sql", 3) == "sql@3" and split_key("sql@3") == ("sql", 3)
    assert split_key("a@b@2") == ("a@b", 2)


def test_concurrent_requests_load_once():
    async def scenario():
        eng = Engine(delay=0.02)
        cache = AdapterCache(eng.load, eng.unload)
        leases = await asyncio.gather(*(cache.acquire("a@1") for _ in range(5)))
        assert eng.loads == ["a@1"] and cache.loads == 1
        assert [lease.hit for lease in leases] == [False] * 5
        assert (await cache.acquire("a@1")).hit
        assert cache.known() == ["a@1"]

    run(scenario())


def test_failed_load_propagates_to_all_waiters_and_retries_later():
    async def scenario():
        eng = Engine(delay=0.01, fail={"a@1"})
        cache = AdapterCache(eng.load, eng.unload)
        results = await asyncio.gather(*(cache.acquire("a@1") for _ in range(3)), return_exceptions=True)
        assert all(isinstance(r, ValueError) for r in results)
        eng.fail.clear()
        assert not (await cache.acquire("a@1")).hit
        assert eng.loads == ["a@1", "a@1"]

    run(scenario())


def test_retire_waits_for_in_flight_requests():
    async def scenario():
        eng = Engine()
        cache = AdapterCache(eng.load, eng.unload)
        await cache.acquire("a@1")  # in flight
        await cache.acquire("a@2")
        cache.release("a@2")
        cache.retire("a", keep=frozenset({"a@2"}))
        assert eng.removed == [] and cache.known() == ["a@2"]
        with pytest.raises(AdapterBlocked):
            await cache.acquire("a@1")  # no new requests for a withdrawn version
        cache.release("a@1")
        assert eng.removed == ["a@1"]

    run(scenario())


def test_block_refuses_and_unblock_allows():
    async def scenario():
        eng = Engine()
        cache = AdapterCache(eng.load, eng.unload)
        await cache.acquire("a@1")
        cache.release("a@1")
        cache.block("a")
        assert eng.removed == ["a@1"]
        with pytest.raises(AdapterBlocked):
            await cache.acquire("a@1")
        cache.unblock("a")
        assert not (await cache.acquire("a@1")).hit

    run(scenario())


def test_capacity_evicts_least_recently_used_idle():
    async def scenario():
        eng = Engine()
        cache = AdapterCache(eng.load, eng.unload, max_known=2)
        for k in ("a@1", "b@1"):
            await cache.acquire(k)
            cache.release(k)
        await cache.acquire("a@1")
        cache.release("a@1")  # a is now more recent than b
        await cache.acquire("c@1")
        assert eng.removed == ["b@1"] and sorted(cache.known()) == ["a@1", "c@1"]
        with pytest.raises(ValueError):
            AdapterCache(eng.load, eng.unload, max_known=0)

    run(scenario())
