"""`LLMServer` (one replica's logic) with the real engine and a real SQLite registry, no Ray:
adapters come only through the registry (sha256 re-checked), hit/miss accounting, and the
change feed's promote/disable without failing a request that is already running."""

import asyncio
import shutil
from pathlib import Path

import pytest

from deployments.bootstrap import sha256_of_dir, bootstrap, demo_paths, make_registry
from deployments.config import load_config
from deployments.engine_settings import engine_config
from deployments.replica.llm_server import LLMServer
from deployments.data_plane.protocol import GenerateRequest

GREEDY = {"max_tokens": 6, "temperature": 0.0, "top_p": 1.0, "seed": None, "stop": []}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from engine_ext import AsyncLLMEngine

    tmp = tmp_path_factory.mktemp("replica")
    registry = {"registry_db": str(tmp / "r.db"), "blob_dir": str(tmp / "blobs"),
                "materialize_dir": str(tmp / "mat"), "allowed_local_roots": [str(tmp / "in")],
                "poll_interval_s": 0.1}
    cfg = bootstrap(load_config({"demo_recipe": "quick", "registry": registry}, env={}))
    paths = demo_paths(cfg)
    reg = make_registry(cfg)
    names = sorted(paths["adapters"])
    for version_src in names[:2]:  # "two" v1 = names[0], v2 = names[1] (ready, not active)
        d = tmp / "in" / f"two-{version_src}"
        shutil.copytree(paths["adapters"][version_src], d)
        reg.register("two", str(d), sha256_of_dir(d), cfg.base_model_name, actor="test",
                     activate=version_src == names[0])
    engine = AsyncLLMEngine(engine_config(cfg, paths["model"]))
    yield cfg, engine, reg, names, tmp
    engine.shutdown()
    reg.close()


async def collect(server, req):
    return [c async for c in server.generate(req)]


def req(key, rid, prompt="import os\n", **sampling):
    return GenerateRequest(rid, key, {**GREEDY, **sampling}, prompt=prompt)


def test_generate_base_and_adapter_with_hit_accounting(env):
    cfg, engine, reg, names, _ = env

    async def scenario():
        server = LLMServer(cfg, engine, reg, "r-test")
        await server.start()
        key = f"{names[0]}@{reg.get(names[0]).active_version}"
        base = await collect(server, req(None, "b1"))
        first = await collect(server, req(key, "a1"))
        second = await collect(server, req(key, "a2"))
        chat = await collect(server, GenerateRequest("c1", key, GREEDY, messages=[{"role": "user", "content": "hi"}]))
        await server.stats.read()  # what the next timer report carries
        snap = server.snapshot(key)["adapters"][key]
        await server.stop()
        return server, key, base, first, second, chat, snap

    server, key, base, first, second, chat, snap = asyncio.run(scenario())
    assert [c["type"] for c in base][0] == "start" and base[-1]["type"] == "end"
    assert first[0]["adapter_hit"] is False and second[0]["adapter_hit"] is True
    assert first[-1]["completion_tokens"] == 6 and first[-1]["finish_reason"] == "length"
    text = lambda chunks: "".join(c["text"] for c in chunks if c["type"] == "delta")  # noqa: E731
    assert text(first) == text(second)
    assert chat[-1]["type"] == "end" and chat[0]["prompt_tokens"] > 2  # chat template applied
    assert key in chat[-1]["snapshot"]["adapters"]  # the last chunk carries the adapter's counters
    # the engine's counters: parsed once, in a slot after the first request
    assert snap["requests"] == 3 and snap["loads"] == 1 and snap["device_loads"] == 1 and snap["hits"] == 2
    stats = server.record_routing_stats()
    assert key in stats["host_adapters"] and stats["num_ongoing"] == 0


def test_corrupt_blob_is_refused_and_nothing_loaded(env, tmp_path):
    cfg, engine, reg, names, tmp = env
    d = tmp / "in" / "corrupt-src"
    shutil.copytree(demo_paths(cfg)["adapters"][names[-1]], d)
    rec = reg.register("corrupt", str(d), sha256_of_dir(d), cfg.base_model_name, actor="test", activate=True)
    weights = rec.files["adapter_model.safetensors"].sha256
    blob = next(p for p in Path(cfg.registry["blob_dir"]).rglob(f"*{weights}*") if p.is_file())
    original = blob.read_bytes()  # blobs are content-addressed: restore it for other adapters
    blob.write_bytes(original[:-8] + b"tampered")

    async def scenario():
        server = LLMServer(cfg, engine, reg, "r-test")
        await server.start()
        chunks = await collect(server, req(f"corrupt@{rec.version}", "x1"))
        ok = await collect(server, req(None, "x2"))
        await server.stop()
        return server, chunks, ok

    try:
        server, chunks, ok = asyncio.run(scenario())
    finally:
        blob.write_bytes(original)
    assert chunks == [{"type": "error", "status": 503, "code": "adapter_load_failed", "message": chunks[0]["message"]}]
    assert "corrupt" in chunks[0]["message"] and not engine.has_adapter(f"corrupt@{rec.version}")
    assert ok[-1]["type"] == "end"  # the replica keeps serving


def test_promote_and_disable_follow_the_change_feed_without_failing_running_requests(env):
    cfg, engine, reg, names, _ = env

    async def scenario():
        server = LLMServer(cfg, engine, reg, "r-test")
        await server.start()
        running = server.generate(req("two@1", "p1", max_tokens=40))
        first = await running.__anext__()  # in flight on v1
        reg.promote("two", 2, actor="test")
        for _ in range(50):  # the SQLite feed polls every 0.1 s here
            await asyncio.sleep(0.1)
            if server.adapters.is_known("two@2"):
                break
        retired = not server.adapters.is_known("two@1")
        rest = [c async for c in running]
        again = await collect(server, req("two@1", "p-again"))  # a late request resolved before the promote
        reg.disable("two", actor="test")
        for _ in range(50):
            await asyncio.sleep(0.1)
            if "two" in server.adapters.blocked():
                break
        disabled = await collect(server, req("two@2", "p3"))
        reg.enable("two", actor="test")
        await server.stop()
        return first, rest, retired, again, disabled

    first, rest, retired, again, disabled = asyncio.run(scenario())
    assert first["type"] == "start" and rest[-1]["type"] == "end" and rest[-1]["completion_tokens"] >= 1
    assert retired  # v1 no longer offered (prefetched v2 instead), while its running request finished on it
    assert again[-1]["type"] == "end"  # and can still be served again (versions are immutable)
    assert disabled[0]["type"] == "error" and disabled[0]["code"] == "model_disabled"


def test_residency_is_published_after_a_load_and_lists_the_new_adapter(env):
    cfg, engine, reg, names, _ = env
    published = []

    async def scenario():
        server = LLMServer(cfg, engine, reg, "r-pub", publish_residency=lambda keys, stats: published.append(
            (list(keys), stats["host_adapters"])))
        await server.start()
        key = f"{names[-1]}@{reg.get(names[-1]).active_version}"
        await collect(server, req(key, "pub1"))
        await collect(server, req(key, "pub2"))  # a hit publishes nothing new
        await server.stop()
        return key

    key = asyncio.run(scenario())
    assert len(published) == 1 and key in published[0][0] and key in published[0][1]


def test_report_carries_every_adapters_speculative_counters(env):
    """The default engine drafts (speculation on, gate deciding); the timer's report names every adapter."""
    cfg, engine, reg, names, _ = env
    assert cfg.engine["speculative"]["gate"] is True

    async def scenario():
        server = LLMServer(cfg, engine, reg, "r-report")
        await server.start()
        keys = [f"{n}@{reg.get(n).active_version}" for n in names[:2]]
        for i, key in enumerate(keys * 2):
            await collect(server, req(key, f"s{i}", max_tokens=12))
        await server.stats.read()  # the stats loop's read, now
        report = server.report()
        await server.stop()
        return keys, report

    keys, report = asyncio.run(scenario())
    spec = report["speculative"]
    assert spec["cycles"] + spec["plain_steps"] > 0 and sum(spec["gate_decisions"].values()) > 0
    for key in keys:  # whether the gate drafted for each is its cost decision (timing): the counters are there
        a = report["adapters"][key]
        assert 0 <= a["accepted_tokens"] <= a["drafted_tokens"] and a["tokens"] > 0, a
        assert (a["acceptance_rate"] is not None) == (a["drafted_tokens"] > 0), a
    assert report["seq"] >= 1
