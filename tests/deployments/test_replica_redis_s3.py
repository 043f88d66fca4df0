"""The cluster configuration path: registry metadata in a real Redis, adapter files in S3
(moto's server), selected purely by the app config's `registry` settings. A replica loads
an adapter from S3 (sha256 re-checked) and follows a promote through Redis pub/sub."""

import asyncio
import shutil
import time
import uuid

import boto3
import pytest

from deployments.bootstrap import sha256_of_dir, bootstrap, demo_paths, make_registry
from deployments.config import load_config
from deployments.engine_settings import engine_config
from deployments.replica.llm_server import LLMServer
from deployments.data_plane.protocol import GenerateRequest


@pytest.fixture()
def cluster_cfg(redis_server, moto_server, tmp_path):
    bucket = f"ls-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=moto_server).create_bucket(Bucket=bucket)
    registry = {"redis_url": redis_server, "redis_prefix": f"test:{uuid.uuid4().hex[:8]}", "s3_bucket": bucket,
                "s3_endpoint_url": moto_server, "materialize_dir": str(tmp_path / "mat"),
                "allowed_local_roots": [str(tmp_path / "in")]}
    return bootstrap(load_config({"demo_recipe": "quick", "registry": registry}, env={})), tmp_path, bucket


def test_replica_on_redis_and_s3(cluster_cfg, moto_server):
    from engine_ext import AsyncLLMEngine

    cfg, tmp, bucket = cluster_cfg
    reg = make_registry(cfg)
    assert type(reg.metadata).__name__.startswith("Redis") and type(reg.blobs).__name__.startswith("S3")
    paths = demo_paths(cfg)
    name = sorted(paths["adapters"])[0]
    assert boto3.client("s3", endpoint_url=moto_server).list_objects_v2(Bucket=bucket)["KeyCount"] > 0
    src = tmp / "in" / "v2"
    shutil.copytree(paths["adapters"][sorted(paths["adapters"])[1]], src)
    v2 = reg.register(name, str(src), sha256_of_dir(src), cfg.base_model_name, actor="test")
    engine = AsyncLLMEngine(engine_config(cfg, paths["model"]))

    async def scenario():
        server = LLMServer(cfg, engine, make_registry(cfg), "r-redis")
        await server.start()
        v1 = reg.get(name).active_version
        chunks = [c async for c in server.generate(GenerateRequest(
            "q1", f"{name}@{v1}", {"max_tokens": 4, "temperature": 0.0, "top_p": 1.0, "seed": None, "stop": []},
            prompt="import os\n"))]
        t0 = time.monotonic()
        reg.promote(name, v2.version, actor="test")
        while time.monotonic() - t0 < 5 and not server.adapters.is_known(f"{name}@{v2.version}"):
            await asyncio.sleep(0.05)
        took = time.monotonic() - t0
        known = server.adapters.known()
        await server.stop()
        return chunks, took, known, v1

    try:
        chunks, took, known, v1 = asyncio.run(scenario())
    finally:
        engine.shutdown()
        reg.close()
    assert chunks[-1]["type"] == "end" and chunks[-1]["completion_tokens"] == 4
    assert took < 5 and f"{name}@{v2.version}" in known and f"{name}@{v1}" not in known


def _bytes_under(path) -> int:
    from pathlib import Path

    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _bucket_objects(endpoint: str, bucket: str) -> dict[str, int]:
    s3 = boto3.client("s3", endpoint_url=endpoint)
    return {o["Key"]: o["Size"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])}


def test_delete_force_frees_the_blobs_and_every_replicas_materialized_copy_at_once(cluster_cfg, moto_server,
                                                                                   monkeypatch, capsys):
    """Two replicas (each its own materialized dir, as on two nodes) serve an adapter from Redis + S3; `lora-registry
    delete NAME --force` (the CLI, direct mode on the same stores) answers the blobs it freed, and within the change
    feed's delivery both replicas' copies are gone from disk, with the default gc grace of 600 s untouched."""
    from engine_ext import AsyncLLMEngine
    from registry.cli import main

    cfg, tmp, bucket = cluster_cfg
    reg = make_registry(cfg)
    assert reg.settings.blob_gc_grace_s == 600
    paths = demo_paths(cfg)
    src = tmp / "in" / "doomed"
    shutil.copytree(paths["adapters"][sorted(paths["adapters"])[0]], src)
    # its own weights: no demo adapter shares a blob with it (the config file is shared, and stays)
    (src / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes()[:-1] + b" ")
    rec = reg.register("doomed", str(src), sha256_of_dir(src), cfg.base_model_name, actor="test", activate=True)
    weights = rec.files["adapter_model.safetensors"]
    homes = [tmp / "node-a", tmp / "node-b"]
    cfgs = [cfg.model_copy(update={"registry": {**cfg.registry, "materialize_dir": str(h)}}) for h in homes]
    engines = [AsyncLLMEngine(engine_config(cfg, paths["model"])) for _ in homes]
    key = f"doomed@{rec.version}"
    env = {"REDIS_URL": cfg.registry["redis_url"], "REDIS_PREFIX": cfg.registry["redis_prefix"], "S3_BUCKET": bucket,
           "S3_ENDPOINT_URL": moto_server, "MATERIALIZE_DIR": str(tmp / "control-plane")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)

    async def scenario():
        servers = [LLMServer(c, e, make_registry(c), f"r{i}") for i, (c, e) in enumerate(zip(cfgs, engines))]
        for s in servers:
            await s.start()
            chunks = [c async for c in s.generate(GenerateRequest(
                f"q-{s.replica_id}", key, {"max_tokens": 2, "temperature": 0.0, "top_p": 1.0, "seed": None, "stop": []},
                prompt="import os\n"))]
            assert chunks[-1]["type"] == "end", chunks
        before = {"replicas": [_bytes_under(h / "doomed") for h in homes], "bucket": _bucket_objects(moto_server, bucket)}
        code = main(["delete", "doomed", "--force"])
        out = capsys.readouterr().out
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10 and any((h / "doomed").exists() for h in homes):
            await asyncio.sleep(0.05)
        took = time.monotonic() - t0
        known = [s.adapters.known() for s in servers]
        for s in servers:
            await s.stop()
        return before, code, out, took, known

    try:
        before, code, out, took, known = asyncio.run(scenario())
    finally:
        for e in engines:
            e.shutdown()
        reg.close()
    after = {"replicas": [_bytes_under(h / "doomed") if (h / "doomed").exists() else 0 for h in homes],
             "bucket": _bucket_objects(moto_server, bucket)}
    print("\ndelete --force:", {"replica_bytes": [before["replicas"], after["replicas"]],
                                "bucket_bytes": [sum(before["bucket"].values()), sum(after["bucket"].values())],
                                "seconds_to_free_replica_copies": round(took, 2)})
    assert code == 0 and weights.sha256 in __import__("json").loads(out)["deleted_blobs"]
    assert all(b >= weights.size for b in before["replicas"]) and after["replicas"] == [0, 0]
    assert any(k.endswith(weights.sha256) for k in before["bucket"])
    assert not any(k.endswith(weights.sha256) for k in after["bucket"])
    assert sum(before["bucket"].values()) - sum(after["bucket"].values()) >= weights.size
    assert all(key not in k for k in known)
