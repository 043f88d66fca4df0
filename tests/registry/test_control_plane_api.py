"""The control-plane REST API: auth (401 without a token, 403 outside the role), tenant scoping for publishers,
every endpoint through a real app, and the audit trail of who did what."""

from __future__ import annotations

import base64
import json

import pytest
from fastapi.testclient import TestClient

from registry.api import create_app
from tests.registry.adapter_kit import BASE, sha_map

TOKENS = {"adm": {"role": "admin", "name": "root"},
          "acme": {"role": "publisher", "tenant": "acme", "name": "pub-acme"},
          "globex": {"role": "publisher", "tenant": "globex", "name": "pub-globex"}}


def H(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def api(make_registry, backend):
    reg = make_registry(backend)
    return TestClient(create_app(reg, TOKENS)), reg


def _register(client, token, name, src, **extra):
    return client.post("/v1/adapters", headers=H(token), json={"name": name, "source_uri": str(src),
                       "sha256": sha_map(src), "base_model": BASE, **extra})


ENDPOINTS = [("post", "/v1/adapters", {}), ("get", "/v1/adapters", None), ("get", "/v1/adapters/x", None),
             ("get", "/v1/adapters/x/versions", None), ("post", "/v1/adapters/x/promote", {"version": 1}),
             ("post", "/v1/adapters/x/canary", {"version": 1, "weight": 0.5}), ("post", "/v1/adapters/x/rollback", None),
             ("post", "/v1/adapters/x/disable", None), ("post", "/v1/adapters/x/enable", None),
             ("delete", "/v1/adapters/x/versions/1", None), ("post", "/v1/base-models", {}), ("get", "/v1/audit", None),
             ("get", "/v1/base-models", None), ("delete", "/v1/adapters/x", None),
             ("post", "/v1/adapters/x/versions/1/retire", None), ("post", "/v1/gc", None),
             ("get", "/v1/uploads/abcdefgh", None), ("get", "/openapi.json", None), ("get", "/docs", None)]


@pytest.mark.parametrize("method,path,body", ENDPOINTS)
@pytest.mark.parametrize("auth", [None, "Bearer wrong", "Basic YWRtOmFkbQ==", "Bearer "])
def test_401_without_valid_token(api, method, path, body, auth):
    client, reg = api
    rev = reg.revision()
    headers = {"Authorization": auth} if auth else {}
    resp = client.request(method, path, headers=headers, json=body)
    browser = path in ("/openapi.json", "/docs")  # pages a browser opens: it is asked for Basic auth
    if browser and auth == "Basic YWRtOmFkbQ==":  # adm:adm, the admin token as the password: let in
        assert resp.status_code == 200
        return
    assert resp.status_code == 401
    assert resp.headers["www-authenticate"] == ('Basic realm="loraserve control plane"' if browser else "Bearer")
    assert resp.json()["error"]["code"] == "unauthorized"
    assert reg.revision() == rev


def test_healthz_needs_no_token(api):
    client, reg = api
    assert client.get("/healthz").json() == {"status": "ok", "revision": reg.revision()}


def test_publisher_is_limited_to_its_tenant(api, stage, tiny_base):
    client, reg = api
    cfg = json.loads((tiny_base / "config.json").read_text())
    assert client.post("/v1/base-models", headers=H("acme"), json={"name": "m2", "config": cfg}).status_code == 403
    assert client.get("/v1/audit", headers=H("acme")).status_code == 403
    r = _register(client, "acme", "x", stage("a"), tenant="globex")
    assert r.status_code == 403 and "globex" in r.json()["error"]["message"]

    r = _register(client, "acme", "acme-pub", stage("a"), activate=True)
    assert r.status_code == 201 and r.json()["owner_tenant"] == "acme" and r.json()["status"] == "active"
    assert _register(client, "acme", "acme-priv", stage("a"), visibility="tenant", activate=True).status_code == 201
    # another tenant: sees the public one but may not manage it; the private one does not exist for it
    assert client.post("/v1/adapters/acme-pub/disable", headers=H("globex")).status_code == 403
    assert client.post("/v1/adapters/acme-priv/disable", headers=H("globex")).status_code == 404
    assert client.get("/v1/adapters/acme-priv", headers=H("globex")).status_code == 404
    assert _register(client, "globex", "acme-pub", stage("b")).status_code == 403  # name owned by acme
    assert [a["name"] for a in client.get("/v1/adapters", headers=H("globex")).json()["items"]] == ["acme-pub"]
    assert [a["name"] for a in client.get("/v1/adapters", headers=H("acme")).json()["items"]] == ["acme-priv",
                                                                                                  "acme-pub"]
    assert reg.get("acme-pub").disabled is False and list(reg.get("acme-pub").versions) == [1]


def test_full_lifecycle_over_http_is_audited(api, stage):
    client, reg = api
    assert _register(client, "acme", "s", stage("a")).status_code == 201
    r2 = _register(client, "acme", "s", stage("b"))
    assert r2.status_code == 201 and r2.json()["version"] == 2 and r2.json()["status"] == "ready"
    steps = [("post", "/v1/adapters/s/promote", {"version": 1}, lambda s: s["active_version"] == 1),
             ("post", "/v1/adapters/s/canary", {"version": 2, "weight": 0.2},
              lambda s: (s["canary_version"], s["canary_weight"]) == (2, 0.2)),
             ("post", "/v1/adapters/s/promote", {"version": 2}, lambda s: s["active_version"] == 2 and s["history"] == [1]),
             ("post", "/v1/adapters/s/rollback", None, lambda s: s["active_version"] == 1),
             ("post", "/v1/adapters/s/disable", None, lambda s: s["disabled"]),
             ("post", "/v1/adapters/s/enable", None, lambda s: not s["disabled"]),
             ("post", "/v1/adapters/s/versions/2/retire", None, lambda s: s["versions"]["2"]["status"] == "retired")]
    for method, path, body, ok in steps:
        resp = client.request(method, path, headers=H("acme"), json=body)
        assert resp.status_code == 200 and ok(resp.json()), (path, resp.text)
    versions = client.get("/v1/adapters/s/versions", headers=H("acme")).json()
    assert [(v["version"], v["status"]) for v in versions] == [(1, "active"), (2, "retired")]
    audit = client.get("/v1/audit", headers=H("adm"), params={"name": "s", "order": "oldest"}).json()
    assert [e["action"] for e in audit] == ["register", "register", "promote", "canary", "promote",
                                            "rollback", "disable", "enable", "retire"]
    newest = client.get("/v1/audit", headers=H("adm"), params={"name": "s", "limit": 3}).json()
    assert newest == audit[::-1][:3]  # newest first by default
    assert {e["actor"] for e in audit} == {"pub-acme"}
    rollback = audit[5]
    assert rollback["before"]["active_version"] == 2 and rollback["after"]["active_version"] == 1
    assert all(e["ts"] > 0 for e in audit)
    page = client.get("/v1/audit", headers=H("adm"), params={"after_seq": audit[-2]["seq"], "order": "oldest"}).json()
    assert [e["action"] for e in page] == ["retire"]


@pytest.mark.parametrize("method,path,body,status,code", [
    ("post", "/v1/adapters/s/promote", {"version": 9}, 404, "adapter_not_found"),
    ("post", "/v1/adapters/s/promote", {"version": 1}, 409, "conflict"),
    ("post", "/v1/adapters/s/rollback", None, 409, "conflict"),
    ("post", "/v1/adapters/s/canary", {"version": 1, "weight": 1.5}, 422, "invalid_request"),
    ("delete", "/v1/adapters/s/versions/1", None, 409, "conflict"),
    ("post", "/v1/adapters/none/enable", None, 404, "adapter_not_found"),
    ("post", "/v1/adapters/s/promote", {"version": "one"}, 422, "invalid_request"),
    ("post", "/v1/adapters/s/promote", {"version": True}, 422, "invalid_request"),
    ("post", "/v1/adapters/s/promote", {"version": "1"}, 422, "invalid_request"),
    ("post", "/v1/adapters/s/promote", {"version": 1.0}, 422, "invalid_request"),
    ("post", "/v1/adapters/s/promote", {"version": 1, "force": True}, 422, "invalid_request"),
    ("post", "/v1/adapters/s/canary", {"version": True, "weight": 0.5}, 422, "invalid_request"),
    ("post", "/v1/adapters/s/canary", {"version": 1, "weight": "0.5"}, 422, "invalid_request"),
    ("post", "/v1/adapters", {"name": "s", "source_uri": "/x", "sha256": {}, "base_model": BASE, "activate": "yes"},
     422, "invalid_request"),
    ("delete", "/v1/adapters/s", None, 409, "conflict"),
])
def test_refused_operations_change_nothing_and_are_audited(api, stage, method, path, body, status, code):
    client, reg = api
    assert _register(client, "adm", "s", stage("a"), activate=True).status_code == 201
    rev, states = reg.revision(), reg.list_states()
    resp = client.request(method, path, headers=H("adm"), json=body)
    assert resp.status_code == status and resp.json()["error"]["code"] == code, resp.text
    assert reg.list_states() == states
    (entry,) = reg.audit(after_seq=rev)  # the refusal itself, who and why
    assert entry.action.endswith("_rejected") and entry.actor == "root" and entry.details["code"] == code


def test_openapi_schema_and_docs_need_the_admin_token(api):
    client, _ = api
    assert client.get("/openapi.json", headers=H("acme")).status_code == 403
    assert client.get("/docs", headers=H("acme")).status_code == 403
    docs = client.get("/docs", headers=H("adm"))
    assert docs.status_code == 200 and "POST /v1/adapters/{name}/promote" in docs.text
    assert "<script" not in docs.text and "http" not in docs.text.replace("http_error", "")  # nothing from elsewhere
    assert "adm" not in docs.text.split("<body>")[1].replace("admin", "")  # the token is not in the page
    # a browser gives the token as the password of HTTP Basic auth (any user name)
    basic = {"Authorization": "Basic " + base64.b64encode(b"me:adm").decode()}
    assert client.get("/docs", headers=basic).status_code == 200
    assert client.get("/v1/adapters", headers=basic).status_code == 401  # the API itself takes Bearer only
    paths = client.get("/openapi.json", headers=basic).json()["paths"]
    assert {"/v1/adapters", "/v1/adapters/{name}", "/v1/adapters/{name}/versions", "/v1/adapters/{name}/promote",
            "/v1/adapters/{name}/canary", "/v1/adapters/{name}/rollback", "/v1/adapters/{name}/disable",
            "/v1/adapters/{name}/enable", "/v1/adapters/{name}/versions/{version}", "/v1/base-models", "/v1/audit",
            "/healthz"} <= set(paths)
    assert "delete" in paths["/v1/adapters/{name}/versions/{version}"]


def test_base_model_registration_over_http(api, tiny_base):
    client, reg = api
    cfg = json.loads((tiny_base / "config.json").read_text())
    r = client.post("/v1/base-models", headers=H("adm"), json={"name": "other", "config": cfg, "aliases": ["org/x"]})
    assert r.status_code == 201 and r.json()["modules"]["down_proj"] == {"block": "mlp", "in_features": 128,
                                                                         "out_features": 64}
    bad = client.post("/v1/base-models", headers=H("adm"), json={"name": "bad", "config": {"model_type": "bert"}})
    assert bad.status_code == 422 and "unsupported" in bad.json()["error"]["message"]
    assert sorted(m["name"] for m in client.get("/v1/base-models", headers=H("acme")).json()) == sorted([BASE, "other"])


def test_admin_adds_a_version_on_behalf_of_the_owner(api, stage):
    client, reg = api
    assert _register(client, "acme", "owned", stage("a"), visibility="tenant").status_code == 201
    r = _register(client, "adm", "owned", stage("b"))
    assert r.status_code == 201 and r.json()["owner_tenant"] == "acme" and r.json()["version"] == 2
    assert _register(client, "adm", "owned", stage("b"), tenant="globex").status_code == 403
