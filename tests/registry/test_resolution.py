"""Acceptance 4 on both backends: rollback restores the previous active version for `resolve`, a disabled adapter
resolves to a clear error, canary weights hold over 10,000 resolutions, and visibility is honoured."""

from __future__ import annotations

import math

import pytest

from registry import AdapterDisabled, AdapterNotFound
from registry.resolver import resolve_version
from tests.registry.adapter_kit import BASE, sha_map


@pytest.fixture
def two_versions(reg, stage):
    for t in ("a", "b"):
        src = stage(t)
        reg.register("sup", str(src), sha_map(src), BASE)
    return reg


def test_rollback_after_promote_restores_previous_active(two_versions):
    reg = two_versions
    reg.promote("sup", 1)
    assert reg.resolve("sup", None).version == 1
    reg.promote("sup", 2)
    assert reg.resolve("sup", None).version == 2
    reg.rollback("sup")
    rec = reg.resolve("sup", None)
    assert rec.version == 1 and rec.status.value == "active"
    assert reg.get("sup").versions[2].status.value == "ready"


def test_disabled_adapter_resolves_to_clear_error_and_enable_restores(two_versions):
    reg = two_versions
    reg.promote("sup", 1)
    reg.disable("sup")
    with pytest.raises(AdapterDisabled, match="'sup' is disabled"):
        reg.resolve("sup", None)
    assert reg.list_adapters() == ()
    reg.enable("sup")
    assert reg.resolve("sup", None).version == 1


def test_unknown_or_unpromoted_adapter_is_not_found(two_versions):
    with pytest.raises(AdapterNotFound):
        two_versions.resolve("nope", None)
    with pytest.raises(AdapterNotFound, match="no active version"):
        two_versions.resolve("sup", None)


@pytest.mark.parametrize("weight", [0.1, 0.5])
def test_canary_weight_honoured_over_10000_resolutions(two_versions, weight):
    reg = two_versions
    reg.promote("sup", 1)
    reg.canary("sup", 2, weight)
    state = reg.get("sup")  # the split itself is pure; one read, then 10,000 resolutions
    n = 10_000
    hits = sum(resolve_version(state, "sup", None, f"req-{i}").version == 2 for i in range(n))
    sigma = math.sqrt(n * weight * (1 - weight))
    assert abs(hits - n * weight) < 4 * sigma, (hits, n * weight)
    # and the same through the store, deterministic per request id
    picks = [reg.resolve("sup", None, request_id=f"req-{i}").version for i in range(200)]
    assert picks == [reg.resolve("sup", None, request_id=f"req-{i}").version for i in range(200)]
    assert picks == [resolve_version(state, "sup", None, f"req-{i}").version for i in range(200)]


def test_tenant_never_resolves_another_tenants_private_adapter(reg, stage):
    src = stage("a")
    reg.register("priv", str(src), sha_map(src), BASE, tenant="acme", visibility="tenant", activate=True)
    src = stage("b")
    reg.register("pub", str(src), sha_map(src), BASE, tenant="acme", visibility="public", activate=True)
    assert reg.resolve("priv", "acme").version == 1
    for other in ("globex", None):
        with pytest.raises(AdapterNotFound):
            reg.resolve("priv", other)
        assert reg.resolve("pub", other).name == "pub"
    assert [r.name for r in reg.list_adapters("globex")] == ["pub"]
    assert sorted(r.name for r in reg.list_adapters("acme")) == ["priv", "pub"]


def test_other_tenant_cannot_add_versions_to_an_adapter(reg, stage):
    from registry import PermissionDenied

    src = stage("a")
    reg.register("owned", str(src), sha_map(src), BASE, tenant="acme", visibility="tenant")
    with pytest.raises(PermissionDenied):
        reg.register("owned", str(src), sha_map(src), BASE, tenant="globex", visibility="tenant")
    assert list(reg.get("owned").versions) == [1]
