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
