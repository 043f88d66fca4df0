"""`/v1/models` at the ingress from the registry's serving catalog: per tenant, current after every change (read
your own writes, and changes made by another process through the change feed), the body re-rendered only after
a change; the resolver reads only the active and canary versions."""

from __future__ import annotations

import time

from fastapi.testclient import TestClient

from deployments.data_plane.openai_api import IngressDeps, create_openai_app
from deployments.data_plane.rate_limit import ColdLoadGate, RateLimiter
from registry import AdapterDisabled, AdapterNotFound, Registry
from tests.registry.adapter_kit import BASE, sha_map

KEYS = {"sk-acme": "acme", "sk-globex": "globex"}


def _ingress(reg) -> TestClient:
    deps = IngressDeps(base_name=BASE, api_keys=KEYS, resolver=reg, llm=None, limiter=RateLimiter((1e6, 1e6), (1e6, 1e6)),
                       gate=ColdLoadGate(), registry_errors=(AdapterNotFound, AdapterDisabled))
    return TestClient(create_openai_app(deps))


def _ids(client, key="sk-acme") -> list[str]:
    r = client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200
    return [m["id"] for m in r.json()["data"]]


def test_models_follow_every_change_per_tenant(reg, stage):
    client = _ingress(reg)
    assert _ids(client) == [BASE]
    a, b = stage("a"), stage("b")
    reg.register("pub", str(a), sha_map(a), BASE, activate=True)
    reg.register("priv", str(b), sha_map(b), BASE, tenant="acme", visibility="tenant", activate=True)
    reg.register("staged-only", str(a), sha_map(a), BASE)  # never promoted: not offered
    assert _ids(client) == [BASE, "priv", "pub"]
    assert _ids(client, "sk-globex") == [BASE, "pub"]
    view = reg.list_adapters("acme")
    assert reg.list_adapters("acme") is view  # a snapshot: the same object until something changes
    reg.disable("pub")
    assert _ids(client) == [BASE, "priv"] and reg.list_adapters("acme") is not view
    reg.enable("pub")
    reg.delete_adapter("priv", force=True)
    assert _ids(client) == [BASE, "pub"]


def test_a_second_registry_process_sees_changes_through_the_feed(make_registry, backend, stage, tmp_path):
    writer = make_registry(backend)
    # Another Registry on the same stores (as the ingress of another replica would be).
    reader = Registry(_same_store(writer), writer.blobs, writer.settings, fetcher=None)
    client = _ingress(reader)
    assert _ids(client) == [BASE]
    a = stage("a")
    writer.register("fed", str(a), sha_map(a), BASE, activate=True)
    catalog = reader.catalog()
    deadline = time.monotonic() + 10
    while "fed" not in {r.name for r in catalog._offered.values()}:  # pushed by the subscription, no read needed
        assert time.monotonic() < deadline, "the change feed did not reach the catalog"
        time.sleep(0.02)
    assert _ids(client) == [BASE, "fed"]
    reader.close()


def _same_store(reg):
    from registry.redis_store import RedisMetadataStore
    from registry.sqlite_store import SQLiteMetadataStore

    if isinstance(reg.metadata, SQLiteMetadataStore):
        return SQLiteMetadataStore(reg.settings.registry_db, poll_interval_s=0.05)
    return RedisMetadataStore(reg.settings.redis_url, reg.settings.redis_prefix)


def test_resolver_reads_only_active_and_canary_versions(reg, stage):
    a = stage("a")
    for _ in range(5):
        reg.register("many", str(a), sha_map(a), BASE)
    reg.promote("many", 4)
    reg.canary("many", 2, 0.5)
    view = reg.metadata.get_serving_state("many")
    assert sorted(view.versions) == [2, 4] and view.active_version == 4
    assert {reg.resolve("many", None, f"r{i}").version for i in range(64)} == {2, 4}
    page = reg.list_page(None, 10)
    assert [s.name for s in page] == ["many"] and sorted(page[0].versions) == [2, 4]


def test_paged_listing_walks_every_adapter_once(make_registry, backend, stage):
    from registry import lifecycle
    from registry.metadata_store import Mutation
    from registry.records import AdapterRecord, AdapterState, AuditEntry

    reg = make_registry(backend)
    names = sorted(f"ad-{i:03d}" for i in range(37))
    for n in names:  # the store's commit path, without files: this test is about paging
        reg.metadata.update(n, lambda before, n=n: Mutation(
            state=lifecycle.add_version(AdapterState(name=n), AdapterRecord(name=n, version=1, base_model=BASE,
                                                                            status="ready")),
            audit=AuditEntry(seq=0, ts=0, actor="t", action="register", name=n)))
    client = TestClient(__import__("registry.api", fromlist=["create_app"]).create_app(
        reg, {"adm": {"role": "admin", "name": "root"}}))
    seen, cursor = [], None
    while True:
        page = client.get("/v1/adapters", headers={"Authorization": "Bearer adm"},
                          params={"limit": 10} | ({"cursor": cursor} if cursor else {})).json()
        seen += [a["name"] for a in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == names
