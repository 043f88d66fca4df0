"""Deleting versions and adapters with their blobs, and garbage collection of unreferenced blobs, on SQLite + a
local directory and on a real redis-server + moto's S3 server. Version numbers are never issued twice."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from registry import AdapterNotFound, LifecycleConflict
from registry.api import create_app
from tests.registry.adapter_kit import BASE, sha_map

ADMIN = {"Authorization": "Bearer adm"}


@pytest.fixture
def reg0(make_registry, backend):
    return make_registry(backend, blob_gc_grace_s=0)


def _blobs(rec) -> set[str]:
    return {f.sha256 for f in rec.files.values()}


def test_delete_version_removes_its_record_and_unshared_blobs(reg0, stage):
    a, b = stage("a"), stage("b")
    r1 = reg0.register("d", str(a), sha_map(a), BASE, activate=True)
    r2 = reg0.register("d", str(b), sha_map(b), BASE)
    shared = _blobs(r1) & _blobs(r2)
    assert shared  # the two adapters' configs are byte-identical: one blob serves both versions
    rev = reg0.revision()
    out = reg0.delete_version("d", 2, actor="carol")
    assert out["deleted_versions"] == [2] and set(out["deleted_blobs"]) == _blobs(r2) - shared
    assert list(reg0.get("d").versions) == [1] and reg0.resolve("d", None).version == 1
    assert set(reg0.blobs.list()) == _blobs(r1)
    (entry,) = reg0.audit(name="d", after_seq=rev)
    assert (entry.action, entry.version, entry.actor) == ("delete_version", 2, "carol")
    assert reg0.materialize(reg0.resolve("d", None)).is_dir()  # the active version's files are intact


def test_active_version_and_adapter_need_force_and_numbers_are_not_reused(reg0, stage):
    a = stage("a")
    reg0.register("d", str(a), sha_map(a), BASE, activate=True)
    reg0.register("d", str(a), sha_map(a), BASE)
    rev, states = reg0.revision(), reg0.list_states()
    with pytest.raises(LifecycleConflict, match="active"):
        reg0.delete_version("d", 1)
    with pytest.raises(LifecycleConflict, match="force"):
        reg0.delete_adapter("d")
    assert reg0.list_states() == states  # refused: nothing changed but the audit log
    assert [e.action for e in reg0.audit(after_seq=rev, newest_first=False)] == ["delete_version_rejected",
                                                                                "delete_adapter_rejected"]
    reg0.delete_version("d", 2)
    out = reg0.delete_adapter("d", force=True, actor="carol")
    assert out["deleted_versions"] == [1] and reg0.blobs.list() == []
    with pytest.raises(AdapterNotFound):
        reg0.get("d")
    with pytest.raises(AdapterNotFound):
        reg0.resolve("d", None)
    assert reg0.list_page() == [] and reg0.list_adapters() == ()
    assert [e.action for e in reg0.audit(name="d", newest_first=True, limit=2)] == ["delete_adapter",
                                                                                  "delete_version"]
    # The name can be registered again, but v1 and v2 meant other weights: replicas key engines by "d@1".
    assert reg0.register("d", str(a), sha_map(a), BASE).version == 3


def test_force_deleting_the_active_version_leaves_no_active(reg0, stage):
    a, b = stage("a"), stage("b")
    reg0.register("d", str(a), sha_map(a), BASE, activate=True)
    reg0.register("d", str(b), sha_map(b), BASE)
    reg0.delete_version("d", 1, force=True)
    state = reg0.get("d")
    assert state.active_version is None and list(state.versions) == [2]
    with pytest.raises(AdapterNotFound):
        reg0.resolve("d", None)


def test_gc_deletes_only_unreferenced_blobs_past_the_grace(make_registry, backend, stage, tmp_path):
    reg = make_registry(backend, blob_gc_grace_s=3600)
    a = stage("a")
    rec = reg.register("keep", str(a), sha_map(a), BASE)
    orphan = tmp_path / "orphan.bin"
    orphan.write_bytes(b"bytes of a registration whose record never committed")
    digest = __import__("hashlib").sha256(orphan.read_bytes()).hexdigest()
    reg.blobs.put(digest, orphan)
    assert reg.collect_garbage() == []  # written just now: a registration may be about to commit it
    assert reg.collect_garbage(grace_s=0) == [digest]
    assert set(reg.blobs.list()) == _blobs(rec)
    assert reg.collect_garbage(grace_s=0) == []


def test_delete_and_gc_over_http_are_audited(reg0, stage):
    client = TestClient(create_app(reg0, {"adm": {"role": "admin", "name": "root"},
                                          "pub": {"role": "publisher", "tenant": "acme"}}))
    a = stage("a")
    body = {"name": "h", "source_uri": str(a), "sha256": sha_map(a), "base_model": BASE, "activate": True}
    assert client.post("/v1/adapters", headers=ADMIN, json=body).status_code == 201
    r = client.delete("/v1/adapters/h", headers=ADMIN)
    assert r.status_code == 409 and "force" in r.json()["error"]["message"]
    assert client.delete("/v1/adapters/h/versions/1", headers=ADMIN).status_code == 409
    r = client.delete("/v1/adapters/h", headers=ADMIN, params={"force": "true"})
    assert r.status_code == 200 and r.json()["deleted_versions"] == [1] and len(r.json()["deleted_blobs"]) == 2
    assert client.get("/v1/adapters/h", headers=ADMIN).status_code == 404
    assert client.delete("/v1/adapters/h", headers=ADMIN).status_code == 404
    assert client.post("/v1/gc", headers={"Authorization": "Bearer pub"}).status_code == 403
    assert client.post("/v1/gc", headers=ADMIN).json() == {"deleted_blobs": []}
    audit = client.get("/v1/audit", headers=ADMIN, params={"name": "h"}).json()
    assert [(e["action"], e["actor"]) for e in audit] == [
        ("delete_adapter_rejected", "root"), ("delete_adapter", "root"), ("delete_version_rejected", "root"),
        ("delete_adapter_rejected", "root"), ("promote", "root"), ("register", "root")]


def test_stale_uploads_are_removed_when_a_new_upload_starts(make_registry, tmp_path):
    import hashlib
    import os

    reg = make_registry("sqlite+local", upload_ttl_s=3600)
    client = TestClient(create_app(reg, {"adm": {"role": "admin", "name": "root"}}))
    stale, fresh = reg.settings.upload_dir / "stale-upload-1", reg.settings.upload_dir / "fresh-upload-1"
    for d in (stale, fresh):
        d.mkdir(parents=True)
        (d / "adapter_config.json").write_text("{}")
    os.utime(stale, (0, 0))
    body = b'{"r": 4}'
    r = client.put("/v1/uploads/new-upload-01/adapter_config.json", content=body,
                   headers=ADMIN | {"X-Content-SHA256": hashlib.sha256(body).hexdigest()})
    assert r.status_code == 200 and r.json()["files"] == {"adapter_config.json": hashlib.sha256(body).hexdigest()}
    assert not stale.exists() and fresh.exists()


def test_materialize_survives_the_empty_name_directory_being_dropped_under_it(reg0, stage, monkeypatch):
    """A replica's change feed drops other versions' copies (drop_materialized removes materialize_dir/NAME when it is
    empty) while a request materializes this one: the drop lands between materialize's mkdir of NAME and its temp
    directory's, and the copy is made all the same."""
    import registry.materialize as materialize

    a = stage("a")
    rec = reg0.register("d", str(a), sha_map(a), BASE, activate=True)
    real_mkdtemp, drops = materialize.tempfile.mkdtemp, []

    def mkdtemp_after_a_drop(**kwargs):
        if not drops:  # once: the change feed's drop of the versions not kept, at the worst moment
            drops.append(reg0.drop_materialized("d", keep={2}))
        return real_mkdtemp(**kwargs)

    monkeypatch.setattr(materialize.tempfile, "mkdtemp", mkdtemp_after_a_drop)
    path = reg0.materialize(rec)
    assert drops == [[]]  # nothing to drop but the empty directory, which went
    assert path.is_dir() and (path / "adapter_model.safetensors").is_file()
