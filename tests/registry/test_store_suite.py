"""Acceptance 1: one parametrized suite for both metadata stores (SQLite file; a real redis-server process) and
both blob stores (local dir; moto's standalone S3 server), plus a scenario that must give the same results on
SQLite + local dir as on Redis + S3."""

from __future__ import annotations

import hashlib
import threading
import time
import uuid

import pytest

from registry import lifecycle
from registry.blob_store import LocalBlobStore
from registry.metadata_store import Mutation
from registry.records import AdapterRecord, AdapterState, AuditEntry
from registry.redis_store import RedisMetadataStore
from registry.s3_blob_store import S3BlobStore
from registry.sqlite_store import SQLiteMetadataStore
from tests.registry.adapter_kit import BASE, sha_map


@pytest.fixture(params=["sqlite", "redis"])
def store(request, tmp_path):
    if request.param == "sqlite":
        s = SQLiteMetadataStore(tmp_path / "m.db", poll_interval_s=0.02)
    else:
        s = RedisMetadataStore(request.getfixturevalue("redis_server"), prefix=f"suite{uuid.uuid4().hex[:8]}")
    yield s
    s.close()


@pytest.fixture(params=["local", "s3"])
def blobs(request, tmp_path):
    if request.param == "local":
        return LocalBlobStore(tmp_path / "blobs")
    import boto3

    client = boto3.client("s3", endpoint_url=request.getfixturevalue("moto_server"))
    bucket = f"suite-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=bucket)
    return S3BlobStore(client, bucket, "pfx")


def add_version(name: str, actor: str = "t", fail: bool = False):
    def fn(before: AdapterState | None) -> Mutation:
        if fail:
            raise ValueError("refused inside the transaction")
        st = before or AdapterState(name=name)
        rec = AdapterRecord(name=name, version=st.next_version(), base_model="b", status="ready")
        after = lifecycle.add_version(st, rec)
        return Mutation(state=after, audit=AuditEntry(seq=0, ts=time.time(), actor=actor, action="add", name=name,
                                                      version=rec.version, details={"k": {}}, before=None,
                                                      after=after.head()))
    return fn


def test_empty_store(store):
    assert store.get_state("x") is None and store.list_states() == []
    assert store.revision() == 0 and store.audit() == [] and store.list_base_models() == []


def test_update_commits_state_audit_and_revision(store):
    state, entry = store.update("a", add_version("a", actor="alice"))
    assert store.get_state("a") == state and list(state.versions) == [1]
    assert entry.seq == store.revision() == 1
    (got,) = store.audit()
    assert got == entry and got.details == {"k": {}} and got.actor == "alice"
    state2, entry2 = store.update("a", add_version("a"))
    assert list(store.get_state("a").versions) == [1, 2] and entry2.seq == 2
    assert store.get_state("a").versions[1] == state.versions[1]


def test_exception_in_transaction_writes_nothing(store):
    store.update("a", add_version("a"))
    with pytest.raises(ValueError, match="refused"):
        store.update("a", add_version("a", fail=True))
    assert list(store.get_state("a").versions) == [1] and store.revision() == 1 and len(store.audit()) == 1


def test_audit_filters_and_pages_in_commit_order(store):
    for name in ("a", "b", "a", "c", "a"):
        store.update(name, add_version(name))
    assert [e.seq for e in store.audit()] == [1, 2, 3, 4, 5]
    assert [e.seq for e in store.audit(name="a")] == [1, 3, 5]
    assert [e.seq for e in store.audit(after_seq=2, limit=2)] == [3, 4]
    assert [e.seq for e in store.audit(name="a", after_seq=1, limit=1)] == [3]
    assert [s.name for s in store.list_states()] == ["a", "b", "c"]


def test_base_models_and_audit_only_entries(store):
    from registry.base_model import spec_from_config

    spec = spec_from_config("m", {"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2,
                                  "intermediate_size": 16, "num_hidden_layers": 1})
    store.update_base_model("m", lambda before: Mutation(base_model=spec, audit=AuditEntry(
        seq=0, ts=1.0, actor="t", action="register_base_model", name="m", before=None)))
    assert store.get_base_model("m") == spec and store.list_base_models() == [spec]
    assert store.get_base_model("other") is None
    e = store.append_audit(AuditEntry(seq=0, ts=2.0, actor="t", action="register_rejected", name="'../x'"))
    assert e.seq == 2 and store.audit()[-1] == e and store.list_states() == []


def test_concurrent_updates_lose_nothing(store):
    errors = []

    def worker():
        try:
            for _ in range(5):
                store.update("hot", add_version("hot"))
        except Exception as e:  # pragma: no cover - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert list(store.get_state("hot").versions) == list(range(1, 51))
    assert [e.version for e in store.audit(limit=1000)] == list(range(1, 51))


def test_subscribers_see_every_mutation(store):
    seen, done = [], threading.Event()

    def cb(event):
        seen.append(event)
        if len(seen) == 3:
            done.set()

    unsubscribe = store.subscribe(cb)
    time.sleep(0.2)  # let the subscription settle before publishing
    try:
        for name in ("a", "b", "a"):
            store.update(name, add_version(name))
        assert done.wait(10), seen
    finally:
        unsubscribe()
    assert seen == [{"name": "a", "action": "add", "revision": 1}, {"name": "b", "action": "add", "revision": 2},
                    {"name": "a", "action": "add", "revision": 3}]


def test_blob_roundtrip(blobs, tmp_path):
    data = b"hello" * 1000
    digest = hashlib.sha256(data).hexdigest()
    (tmp_path / "f").write_bytes(data)
    assert not blobs.exists(digest)
    progress = []
    blobs.put(digest, tmp_path / "f", progress.append)
    blobs.put(digest, tmp_path / "f")  # idempotent
    assert blobs.exists(digest) and blobs.list() == [digest] and sum(progress) == len(data)
    blobs.get(digest, tmp_path / "out")
    assert (tmp_path / "out").read_bytes() == data
    with pytest.raises(FileNotFoundError):
        blobs.get("0" * 64, tmp_path / "missing")
    with pytest.raises(ValueError, match="sha256"):
        blobs.put("../../etc/passwd", tmp_path / "f")


def _normalized(reg) -> tuple:
    states = [s.model_dump(exclude={"versions": {"__all__": {"created_at", "updated_at", "blob_location",
                                                             "source_uri"}}}) for s in reg.list_states()]
    audit = [(e.seq, e.action, e.name, e.version, e.details.get("code"), e.before, e.after)
             for e in reg.audit(limit=1000)]
    return states, audit


def test_same_results_on_sqlite_local_and_redis_s3(make_registry, stage):
    outcomes = []
    for backend in ("sqlite+local", "redis+s3"):
        reg = make_registry(backend)
        a, b = stage("a"), stage("b")
        reg.register("s", str(a), sha_map(a), BASE, activate=True)
        reg.register("s", str(b), sha_map(b), BASE)
        with pytest.raises(Exception):
            reg.register("s", str(b), {**sha_map(b), "adapter_model.safetensors": "f" * 64}, BASE)
        reg.canary("s", 2, 0.3)
        reg.promote("s", 2)
        reg.rollback("s")
        reg.retire("s", 2)
        reg.disable("s")
        materialized = sha_map(reg.materialize(reg.get("s").versions[1]))
        outcomes.append((_normalized(reg), sorted(reg.blobs.list()), materialized))
    assert outcomes[0] == outcomes[1]
