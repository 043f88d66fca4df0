"""The replica's adapter bookkeeping over the engine (`ReplicaAdapters`), with a fake engine and registry: the
engine's host cache is the one record of residency; the replica loads through the registry once per version,
refuses disabled adapters, withdraws versions no longer served and orders the engine's evictions."""

import asyncio
from dataclasses import dataclass

import pytest

from deployments.replica.adapters import AdapterBlocked, AdapterLoadFailed, ReplicaAdapters
from deployments.replica.placement import ReplicaPlacement
from engine_ext.core.eviction_order import HostEvictionOrder
from router.placement import PlacementConfig


@dataclass
class Rec:
    name: str
    version: int


class Engine:
    """The engine's adapter surface: registrations, a host LRU of `capacity` evicting by the engine's own
    rank-ordered policy."""

    def __init__(self, capacity=8, fail=()):
        self.paths, self.host, self.capacity, self.fail, self.added = {}, [], capacity, set(fail), []
        self.order = HostEvictionOrder()
        self.dropped = []  # keys whose prefix-cache blocks were dropped

    def drop_cached_prefixes(self, key):
        self.dropped.append(key)
        return 0

    def rank_host_eviction(self, ranks, replace=False):
        self.order.rank(ranks, replace)

    def has_adapter(self, key):
        return key in self.paths

    def host_adapters(self):
        return list(self.host)

    def add_adapter(self, key, path):
        self.added.append(key)
        if key in self.fail:
            raise ValueError(f"bad adapter {key}")
        self.paths[key] = path
        self.host.append(key)
        while len(self.host) > self.capacity:
            victim = self.order.choose([k for k in self.host if k != key])
            if victim is None:
                break
            self.host.remove(victim)


class Registry:
    def __init__(self, delay=0.0):
        self.delay, self.materialized, self.gets = delay, [], []

    def get(self, name):
        self.gets.append(name)

        class State:
            versions = {v: Rec(name, v) for v in range(1, 5)}
        return State()

    def materialize(self, rec):
        import time

        time.sleep(self.delay)
        self.materialized.append((rec.name, rec.version))
        return f"/mat/{rec.name}/v{rec.version}"


def make(engine=None, registry=None, tiers=None):
    placement = ReplicaPlacement(PlacementConfig(), clock=lambda: 0.0)
    placement.share = {"version": 1, "tiers": tiers or {}}
    engine, registry = engine or Engine(), registry or Registry()
    return ReplicaAdapters(engine, registry, placement), engine, registry, placement


def run(coro):
    return asyncio.run(coro)


def test_concurrent_requests_load_once_through_the_record_the_ingress_resolved():
    async def scenario():
        adapters, engine, registry, _ = make(registry=Registry(delay=0.05))
        results = await asyncio.gather(*(adapters.acquire("a@1", Rec("a", 1)) for _ in range(5)))
        assert engine.added == ["a@1"] and registry.materialized == [("a", 1)]
        assert registry.gets == []  # the record came with the request
        assert [hit for hit, _ in results] == [False] * 5
        assert (await adapters.acquire("a@1"))[0] is True
        assert adapters.known() == ["a@1"]

    run(scenario())


def test_a_prefetch_reads_the_record_from_the_registry():
    async def scenario():
        adapters, engine, registry, _ = make()
        await adapters.acquire("b@2")
        assert registry.gets == ["b"] and registry.materialized == [("b", 2)] and engine.has_adapter("b@2")

    run(scenario())


def test_each_version_keeps_the_cause_of_the_load_that_registered_it():
    async def scenario():
        adapters, engine, _, _ = make(registry=Registry(delay=0.05))
        # a placement prefetch and a request for the same version at once: one load, the prefetch's
        await asyncio.gather(adapters.acquire("a@1", cause="placement"), adapters.acquire("a@1", Rec("a", 1)))
        await adapters.acquire("b@1", Rec("b", 1))
        await adapters.acquire("b@1", cause="placement")  # already registered: the request's stays
        await adapters.acquire("c@2", cause="change")
        assert engine.added == ["a@1", "b@1", "c@2"]
        assert adapters.registered_by() == {"a@1": "placement", "b@1": "request", "c@2": "change"}
        with pytest.raises(ValueError, match="cause"):
            await adapters.acquire("d@1", cause="prefetch")
        assert not engine.has_adapter("d@1")

    run(scenario())


def test_failed_load_propagates_to_all_waiters_and_is_tried_again_later():
    async def scenario():
        adapters, engine, registry, _ = make(engine=Engine(fail={"a@1"}), registry=Registry(delay=0.02))
        results = await asyncio.gather(*(adapters.acquire("a@1") for _ in range(3)), return_exceptions=True)
        # the engine's refusal, typed as the replica's (a 503 adapter_load_failed to the client), to every waiter
        assert all(isinstance(r, AdapterLoadFailed) and isinstance(r.__cause__, ValueError) for r in results)
        assert engine.added == ["a@1"]
        engine.fail.clear()
        assert (await adapters.acquire("a@1"))[0] is False
        assert engine.added == ["a@1", "a@1"]

    run(scenario())


def test_retired_versions_are_not_offered_but_still_served_to_a_late_request():
    async def scenario():
        adapters, engine, _, _ = make()
        for key in ("a@1", "a@2"):
            await adapters.acquire(key)
        adapters.retire("a", keep=frozenset({"a@2"}))
        assert adapters.known() == ["a@2"] and engine.host_adapters() == ["a@1", "a@2"]
        assert (await adapters.acquire("a@1"))[0] is True  # resolved before the promote: served
        adapters.retire("a", keep=frozenset({"a@1", "a@2"}))  # rolled back
        assert adapters.known() == ["a@1", "a@2"]
        adapters.retire("a", keep=frozenset({"a@1"}))
        adapters.retire("a", keep=frozenset({"a@1"}))  # again: nothing newly withdrawn
        assert engine.dropped == ["a@1", "a@2"]  # each withdrawal drops that version's cached prompt KV

    run(scenario())


def test_block_refuses_and_unblock_allows():
    async def scenario():
        adapters, _, _, _ = make()
        await adapters.acquire("a@1")
        adapters.block("a")
        assert adapters.known() == [] and adapters.blocked() == ["a"]
        with pytest.raises(AdapterBlocked):
            await adapters.acquire("a@1")
        adapters.unblock("a")
        assert (await adapters.acquire("a@1"))[0] is True and adapters.known() == ["a@1"]

    run(scenario())


def test_the_engine_evicts_withdrawn_versions_then_by_placement_and_keeps_homes():
    async def scenario():
        adapters, engine, _, placement = make(engine=Engine(capacity=3), tiers={"w": "warm", "c": "cold"})
        for key in ("w@1", "x@1", "c@1"):
            await adapters.acquire(key)
        for _ in range(3):
            adapters.note_request("x@1")
        await adapters.acquire("y@1")  # over by one: x (homed elsewhere) before the cold home c; w stays
        assert engine.host_adapters() == ["w@1", "c@1", "y@1"]
        adapters.retire("c", keep=frozenset())
        await adapters.acquire("z@1")  # a withdrawn version goes first, even before a copy homed elsewhere
        assert engine.host_adapters() == ["w@1", "y@1", "z@1"]
        assert adapters.rank("w@1") is None  # a warm home is never chosen

    run(scenario())
