"""The change feed replicas follow (revision + subscribe) and building a Registry from environment settings."""

from __future__ import annotations

import threading
import time
import uuid

from registry import Registry, RegistrySettings
from registry.blob_store import LocalBlobStore
from registry.redis_store import RedisMetadataStore
from registry.s3_blob_store import S3BlobStore
from registry.sqlite_store import SQLiteMetadataStore
from tests.registry.adapter_kit import BASE, sha_map


def test_subscribers_learn_of_every_mutation(reg, stage):
    events, got_all = [], threading.Event()

    def on_event(e):
        events.append(e)
        if len(events) >= 4:
            got_all.set()

    unsubscribe = reg.subscribe(on_event)
    time.sleep(0.2)
    try:
        rev0 = reg.revision()
        src = stage("a")
        reg.register("feed", str(src), sha_map(src), BASE)  # one commit, after validation
        reg.promote("feed", 1)
        reg.disable("feed")
        reg.enable("feed")
        assert got_all.wait(10), events
    finally:
        unsubscribe()
    assert reg.revision() == rev0 + 4
    assert [(e["name"], e["action"]) for e in events] == [("feed", "register"), ("feed", "promote"),
                                                          ("feed", "disable"), ("feed", "enable")]
    assert [e["revision"] for e in events] == list(range(rev0 + 1, rev0 + 5))


def test_settings_from_env_parse_lists(monkeypatch, tmp_path):
    monkeypatch.setenv("ALLOWED_LOCAL_ROOTS", f"{tmp_path}/a, {tmp_path}/b")
    monkeypatch.setenv("ALLOWED_S3_PREFIXES", "s3://in/up/")
    monkeypatch.setenv("MAX_LORA_RANK", "16")
    monkeypatch.setenv("REGISTRY_DB", str(tmp_path / "x.db"))
    s = RegistrySettings()
    assert [str(p) for p in s.allowed_local_roots] == [f"{tmp_path}/a", f"{tmp_path}/b"]
    assert s.allowed_s3_prefixes == ["s3://in/up/"] and s.max_lora_rank == 16 and s.redis_url is None
    reg = Registry.from_settings(s)
    assert isinstance(reg.metadata, SQLiteMetadataStore) and isinstance(reg.blobs, LocalBlobStore)
    reg.close()


def test_redis_url_and_s3_bucket_switch_backends(monkeypatch, tmp_path, redis_server, s3_endpoint, incoming_root,
                                                 tiny_base, stage):
    import boto3

    bucket = f"env-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=bucket)
    for k, v in {"REDIS_URL": redis_server, "REDIS_PREFIX": f"env{uuid.uuid4().hex[:6]}", "S3_BUCKET": bucket,
                 "S3_PREFIX": "adapters", "S3_ENDPOINT_URL": s3_endpoint, "ALLOWED_LOCAL_ROOTS": str(incoming_root),
                 "MATERIALIZE_DIR": str(tmp_path / "mat")}.items():
        monkeypatch.setenv(k, v)
    reg = Registry.from_settings()
    assert isinstance(reg.metadata, RedisMetadataStore) and isinstance(reg.blobs, S3BlobStore)
    reg.register_base_model(BASE, tiny_base)
    src = stage("a")
    rec = reg.register("envy", str(src), sha_map(src), BASE, activate=True)
    assert rec.blob_location == f"s3://{bucket}/adapters"
    keys = [o["Key"] for o in boto3.client("s3", endpoint_url=s3_endpoint).list_objects_v2(Bucket=bucket)["Contents"]]
    assert sorted(keys) == sorted(f"adapters/sha256/{f.sha256}" for f in rec.files.values())
    assert sha_map(reg.materialize(reg.resolve("envy", None)))["adapter_model.safetensors"] == \
        sha_map(src)["adapter_model.safetensors"]
    reg.close()
