"""A replica acting on the placement (real engine, real registry, no Ray): pinned and warm homes
loaded before any request (pinned ones on the device and pinned in the engine), unpinned when
demoted, evicted by placement and popularity rather than recency; and a replica stopped during
a promote catching up from the change feed when it starts again (real redis-server)."""

import asyncio
import shutil
import time
import uuid
from pathlib import Path

import pytest

from deployments.bootstrap import bootstrap, demo_paths, make_registry, sha256_of_dir
from deployments.config import load_config
from deployments.engine_settings import engine_config
from deployments.replica.llm_server import LLMServer
from deployments.data_plane.protocol import GenerateRequest
from deployments.replica.placement import ReplicaPlacement
from router.placement import PlacementConfig

GREEDY = {"max_tokens": 2, "temperature": 0.0, "top_p": 1.0, "seed": None, "stop": []}


def test_replica_placement_orders_victims_and_lists_homes():
    clock = [0.0]
    rp = ReplicaPlacement(PlacementConfig(half_life_s=100.0), clock=lambda: clock[0])
    rp.share = {"version": 3, "tiers": {"p": "pinned", "w": "warm", "c": "cold"}}
    for key, n in (("c@1", 5), ("x@1", 50), ("y@1", 1), ("z@1", 2)):
        for _ in range(n):
            rp.note_request(key)
    order = sorted(["p@1", "w@1", "c@1", "x@1", "y@1", "z@1"], key=rp.victim_key)
    # homed elsewhere first (fewest requests first, however popular), then cold, warm, pinned homes
    assert order == ["y@1", "z@1", "x@1", "c@1", "w@1", "p@1"]
    assert [rp.protected(k) for k in ("p@1", "w@1", "c@1", "x@1")] == [True, True, False, False]
    assert rp.homes() == ["p", "w"] and rp.wanted() == [("p", 0), ("w", 1)]


def register_copies(reg, cfg, tmp, names, count):
    paths = demo_paths(cfg)["adapters"]
    for i in range(count):
        name = f"pl-{i:02d}"
        d = tmp / "in" / f"{name}-{uuid.uuid4().hex[:6]}"
        shutil.copytree(paths[names[i % len(names)]], d)
        reg.register(name, str(d), sha256_of_dir(d), cfg.base_model_name, actor="test", activate=True)


def make_env(tmp, registry_extra, **cfg_extra):
    registry = {"registry_db": str(tmp / "r.db"), "blob_dir": str(tmp / "blobs"),
                "materialize_dir": str(tmp / "mat"), "allowed_local_roots": [str(tmp / "in")],
                "poll_interval_s": 0.1, **registry_extra}
    cfg = bootstrap(load_config({"demo_recipe": "quick", "registry": registry, "max_loras": 4, "max_cpu_loras": 4,
                                 "placement_period_s": 0.2, **cfg_extra}, env={}))
    return cfg, make_registry(cfg), sorted(demo_paths(cfg)["adapters"])


@pytest.fixture(scope="module")
def engine_env(tmp_path_factory):
    from engine_ext import AsyncLLMEngine

    tmp = tmp_path_factory.mktemp("placement")
    cfg, reg, names = make_env(tmp, {})
    register_copies(reg, cfg, tmp, names, 8)
    engine = AsyncLLMEngine(engine_config(cfg, demo_paths(cfg)["model"]))
    yield cfg, engine, reg
    engine.shutdown()
    reg.close()


class Plan:
    """The controller's answer to this replica's sync (a real plan shape, set by the test)."""

    def __init__(self, tiers):
        self.share = {"version": 1, "tiers": tiers}
        self.calls = 0

    async def __call__(self, replica_id, report):
        self.calls += 1
        self.report = report
        return self.share


async def wait_until(pred, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.1)


def test_replica_prefetches_pins_and_unpins_homes(engine_env):
    cfg, engine, reg = engine_env
    plan = Plan({"pl-00": "pinned", "pl-01": "warm", "pl-02": "cold"})

    async def scenario():
        server = LLMServer(cfg, engine, reg, "r-place", placement_sync=plan)
        await server.start()
        try:
            await wait_until(lambda: {"pl-00@1", "pl-01@1"} <= set(server.adapters.known())
                             and server.placement.pinned == {"pl-00@1"})
            stats = await asyncio.to_thread(engine.stats)
            pinned_in_engine = set(stats["pinned_adapters"])
            routing = server.record_routing_stats()
            first = [c async for c in server.generate(GenerateRequest("q1", "pl-00@1", GREEDY, prompt="x = 1\n"))]
            plan.share = {"version": 2, "tiers": {"pl-00": "cold", "pl-01": "warm"}}
            await wait_until(lambda: server.placement.pinned == set())
            after = await asyncio.to_thread(engine.stats)
            return stats, pinned_in_engine, routing, first, set(after["pinned_adapters"])
        finally:
            await server.stop()

    stats, pinned_in_engine, routing, first, pinned_after = asyncio.run(scenario())
    assert "pl-00@1" in stats["device_adapters"]  # on the device before its first request
    assert "pl-02@1" not in routing["host_adapters"]  # cold: fetched on demand only
    assert pinned_in_engine == {"pl-00@1"} and pinned_after == set()
    assert routing["homes"] == ["pl-00", "pl-01"] and routing["placement_version"] == 1
    assert first[0]["adapter_hit"] is True  # the prefetch made the first request a hit


def test_eviction_keeps_homes_and_drops_copies_homed_elsewhere_first(engine_env):
    cfg, engine, reg = engine_env  # max_cpu_loras 4
    plan = Plan({"pl-03": "warm", "pl-04": "cold"})

    async def scenario():
        server = LLMServer(cfg, engine, reg, "r-evict", placement_sync=plan)
        await server.start()
        try:
            await wait_until(lambda: "pl-03@1" in server.adapters.known())
            async def run(key, rid):
                return [c async for c in server.generate(GenerateRequest(rid, key, GREEDY, prompt="y\n"))]

            for i, key in enumerate(["pl-04@1", "pl-05@1", "pl-05@1", "pl-06@1"]):
                await run(key, f"e{i}")
            # full (4): pl-03 (warm home), pl-04 (cold home), pl-05 (2 requests), pl-06 (1 request, newest)
            await run("pl-07@1", "e9")
            return server.adapters.known()
        finally:
            await server.stop()

    known = set(asyncio.run(scenario()))
    # LRU would drop pl-03 (loaded first, never used); the placement drops a copy homed elsewhere,
    # the least requested one: pl-06 (1 request) rather than pl-05 (2)
    assert known == {"pl-03@1", "pl-04@1", "pl-05@1", "pl-07@1"}


def test_replica_stopped_during_a_promote_serves_the_promoted_version_after_restart(tmp_path, redis_server):
    from engine_ext import AsyncLLMEngine

    cfg, reg, names = make_env(tmp_path, {"redis_url": redis_server, "redis_prefix": f"pl{uuid.uuid4().hex[:6]}"})
    d1, d2 = tmp_path / "in" / "v1", tmp_path / "in" / "v2"
    shutil.copytree(demo_paths(cfg)["adapters"][names[0]], d1)
    shutil.copytree(demo_paths(cfg)["adapters"][names[1]], d2)
    reg.register("promo", str(d1), sha256_of_dir(d1), cfg.base_model_name, actor="t", activate=True)
    reg.register("promo", str(d2), sha256_of_dir(d2), cfg.base_model_name, actor="t")
    engine = AsyncLLMEngine(engine_config(cfg, demo_paths(cfg)["model"]))

    async def scenario():
        server = LLMServer(cfg, engine, reg, "r-promo")
        await server.start()
        await asyncio.sleep(0.5)
        first = [c async for c in server.generate(GenerateRequest("p1", "promo@1", GREEDY, prompt="z\n"))]
        await server.stop()  # down ...
        reg.promote("promo", 2, actor="t")  # ... while the promote happens
        await asyncio.sleep(0.5)
        assert server.adapters.known() == ["promo@1"]  # it did not see it
        await server.start()  # back: replays the feed from its saved offset
        await wait_until(lambda: server.adapters.known() == ["promo@2"], timeout=30)
        second = [c async for c in server.generate(GenerateRequest("p2", "promo@2", GREEDY, prompt="z\n"))]
        await server.stop()
        return first, second

    try:
        first, second = asyncio.run(scenario())
    finally:
        engine.shutdown()
        reg.close()
    assert first[-1]["type"] == "end" and second[-1]["type"] == "end"
    assert second[0]["adapter_hit"] is True  # warmed where the old version lived, before traffic


def test_a_canary_is_warmed_where_the_active_version_lives(engine_env, tmp_path):
    cfg, engine, reg = engine_env
    paths = demo_paths(cfg)["adapters"]
    names = sorted(paths)
    incoming = Path(reg.settings.allowed_local_roots[0])
    for i, src in enumerate(names[:2]):
        d = incoming / f"cn-{i}-{uuid.uuid4().hex[:6]}"
        shutil.copytree(paths[src], d)
        reg.register("cn", str(d), sha256_of_dir(d), cfg.base_model_name, actor="t", activate=i == 0)

    async def scenario():
        server = LLMServer(cfg, engine, reg, "r-canary")
        await server.start()
        try:
            await asyncio.sleep(0.3)
            [c async for c in server.generate(GenerateRequest("c1", "cn@1", GREEDY, prompt="q\n"))]
            reg.canary("cn", 2, 0.1, actor="t")
            await wait_until(lambda: server.adapters.is_known("cn@2"), timeout=20)
            return server.adapters.known()
        finally:
            await server.stop()

    assert {"cn@1", "cn@2"} <= set(asyncio.run(scenario()))
