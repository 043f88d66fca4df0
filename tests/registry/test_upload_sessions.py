"""Uploads as sessions, over the control plane's HTTP API on both backend pairs (SQLite + local dir, a real
redis-server + moto's S3 server): a registration refused for a wrong sha256 leaves the upload for the corrected
one, which needs no new upload and ends the session; the upload area is bounded and reports what it holds."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from registry.api import create_app
from tests.registry.adapter_kit import BASE, sha_map

ADMIN = {"Authorization": "Bearer admin-token"}


class CountingClient:
    """The TestClient, counting the files PUT into the upload area."""

    def __init__(self, client: TestClient):
        self.client, self.puts = client, 0

    def upload(self, upload_id: str, src: Path) -> str:
        for p in sorted(src.iterdir()):
            r = self.client.put(f"/v1/uploads/{upload_id}/{p.name}", content=p.read_bytes(),
                                headers=ADMIN | {"X-Content-SHA256": sha_map(src)[p.name]})
            assert r.status_code == 200, r.text
            self.puts += 1
        return self.client.get(f"/v1/uploads/{upload_id}", headers=ADMIN).json()["source_uri"]


@pytest.fixture
def api(make_registry, backend):
    reg = make_registry(backend)
    return CountingClient(TestClient(create_app(reg, {"admin-token": {"role": "admin", "name": "root"}}))), reg


def test_a_registration_refused_for_a_wrong_sha256_succeeds_retried_with_the_right_one_without_a_new_upload(api, stage):
    http, reg = api
    src = stage("a")
    uri = http.upload("typo-upload-01", src)
    right = sha_map(src)
    wrong = {**right, "adapter_model.safetensors": "0" * 64}
    body = {"name": "typo", "source_uri": uri, "base_model": BASE}
    refused = http.client.post("/v1/adapters", headers=ADMIN, json=body | {"sha256": wrong})
    assert refused.status_code == 422 and refused.json()["error"]["code"] == "sha256_mismatch", refused.text
    session = http.client.get("/v1/uploads/typo-upload-01", headers=ADMIN).json()
    assert session["files"] == right and session["expires_at"] > 0  # the session lives on
    puts = http.puts
    done = http.client.post("/v1/adapters", headers=ADMIN, json=body | {"sha256": right})
    assert done.status_code == 201, done.text
    assert http.puts == puts  # not a byte uploaded again
    assert set(reg.blobs.list()) == set(right.values())
    assert not Path(uri).exists()  # registered: the files are in the blob store and the session has ended
    assert http.client.get("/v1/uploads", headers=ADMIN).json()["sessions"] == []


def test_the_upload_area_is_bounded_and_reports_its_sessions(make_registry, stage):
    src = stage("a")
    sizes = {p.name: p.stat().st_size for p in src.iterdir()}
    weights, bound = sizes["adapter_model.safetensors"], sum(sizes.values())  # room for one adapter
    reg = make_registry("sqlite+local", max_upload_area_bytes=bound)
    client = TestClient(create_app(reg, {"admin-token": {"role": "admin", "name": "root"}}))
    sha = sha_map(src)

    def put(upload_id: str, name: str, declared: bool = True):
        content = (src / name).read_bytes()
        body = content if declared else iter([content])  # an iterator: sent chunked, no Content-Length
        return client.put(f"/v1/uploads/{upload_id}/{name}", content=body,
                          headers=ADMIN | {"X-Content-SHA256": sha[name]})

    assert put("first-upload", "adapter_model.safetensors").status_code == 200
    usage = client.get("/v1/uploads", headers=ADMIN).json()
    assert usage["bytes"] == weights and usage["max_bytes"] == bound
    assert [(s["upload_id"], s["bytes"], s["files"]) for s in usage["sessions"]] == [("first-upload", weights, 1)]
    for declared in (True, False):  # refused from its Content-Length, or cut off as it streams
        full = put("second-upload", "adapter_model.safetensors", declared)
        assert full.status_code == 507 and full.json()["error"]["code"] == "upload_area_full", full.text
    assert not (Path(reg.settings.upload_dir) / "second-upload").exists()  # nothing of the refused file stays
    assert client.get("/v1/uploads", headers=ADMIN).json()["bytes"] == weights
    assert client.get("/v1/uploads", headers={"Authorization": "Bearer nope"}).status_code == 401
    # the area frees as sessions end: the first one registered, the second file fits
    assert put("first-upload", "adapter_config.json").status_code == 200
    uri = client.get("/v1/uploads/first-upload", headers=ADMIN).json()["source_uri"]
    assert client.post("/v1/adapters", headers=ADMIN, json={"name": "fits", "source_uri": uri, "base_model": BASE,
                                                             "sha256": sha}).status_code == 201
    assert put("second-upload", "adapter_model.safetensors").status_code == 200


def test_bearer_tokens_only_and_a_basic_header_is_told_so(make_registry):
    client = TestClient(create_app(make_registry("sqlite+local"), {"admin-token": {"role": "admin"}}))
    r = client.get("/v1/adapters", headers={"Authorization": "Basic " + "YWRtaW46YWRtaW4tdG9rZW4="})
    assert r.status_code == 401 and "expected a bearer token" in r.json()["error"]["message"]
    assert r.headers["WWW-Authenticate"] == "Bearer"
    assert "missing bearer token" in client.get("/v1/adapters").json()["error"]["message"]
