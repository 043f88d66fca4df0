"""Which version serves a request: visibility, the disabled flag, and the canary split.

The split hashes (adapter name, request id) to a point in [0, 1), so a retried request lands on the same
version and the share of canary traffic converges to the weight.
"""

from __future__ import annotations

import hashlib
import uuid

from registry.errors import AdapterDisabled, AdapterNotFound
from registry.records import AdapterRecord, AdapterState

__all__ = ["resolve_version", "split_point"]


def split_point(name: str, request_id: str) -> float:
    """Deterministic uniform point in [0, 1) for a request."""
    digest = hashlib.sha256(f"{name}\x00{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def resolve_version(state: AdapterState | None, name: str, tenant: str | None,
                    request_id: str | None = None) -> AdapterRecord:
    # An adapter the tenant may not see is reported exactly like one that does not exist.
    active = state.versions.get(state.active_version) if state is not None and state.active_version else None
    if active is None or not active.visible_to(tenant):
        raise AdapterNotFound(f"adapter {name!r} not found or has no active version")
    if state.disabled:
        raise AdapterDisabled(f"adapter {name!r} is disabled")
    if state.canary_version is not None and state.canary_weight > 0.0:
        point = split_point(name, request_id if request_id is not None else uuid.uuid4().hex)
        candidate = state.versions.get(state.canary_version)
        if point < state.canary_weight and candidate is not None and candidate.visible_to(tenant):
            return candidate
    return active
