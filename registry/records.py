"""Pydantic records: one adapter version, the per-adapter head (which version serves), audit entries.

An adapter's whole state is `AdapterState` = head fields + all its versions; every lifecycle mutation is a
pure function AdapterState -> AdapterState (see lifecycle.py), which is what makes the audit log replayable.
"""

from __future__ import annotations

import re
import time
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from registry.canary_policy import GoldenPrompt
from registry.rollout_state import Rollout

__all__ = [
    "AdapterStatus",
    "Visibility",
    "FileEntry",
    "AdapterRecord",
    "AdapterState",
    "AuditEntry",
    "NAME_PATTERN",
    "SERVABLE_STATUSES",
]

# Names end up in URLs, Redis keys, cache paths and the OpenAI `model` field ("base:adapter"), so they are
# restricted to a conservative alphabet with no path separators and no colon.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class AdapterStatus(str, Enum):
    staged = "staged"  # older records only: registration now records a version once its files validated
    ready = "ready"  # validated and stored, not serving
    active = "active"  # the version `resolve` returns
    canary = "canary"  # served to a weighted share of requests beside the active one
    disabled = "disabled"  # would serve, but the adapter is switched off
    retired = "retired"  # withdrawn for good; never served again
    failed = "failed"  # older records only: a refusal now records nothing (see the register_rejected audit entry)


# Versions whose status follows from the head (active/canary pointers and the disabled flag).
SERVABLE_STATUSES = frozenset({AdapterStatus.ready, AdapterStatus.active, AdapterStatus.canary, AdapterStatus.disabled})


class Visibility(str, Enum):
    public = "public"
    tenant = "tenant"


class FileEntry(BaseModel):
    model_config = ConfigDict(frozen=True)
    sha256: str = Field(description="hex sha256 of the file's bytes; also its key in the blob store")
    size: int = Field(ge=0, description="bytes")


class AdapterRecord(BaseModel):
    """One version of one adapter."""

    name: str
    version: int = Field(ge=1, description="monotonic per adapter name")
    base_model: str
    rank: int | None = None
    alpha: float | None = None
    target_modules: list[str] = Field(default_factory=list)
    dtype: str | None = Field(default=None, description="safetensors dtype of the LoRA tensors, e.g. F32")
    files: dict[str, FileEntry] = Field(default_factory=dict, description="file name -> sha256 and size")
    owner_tenant: str | None = None
    visibility: Visibility = Visibility.public
    status: AdapterStatus = AdapterStatus.staged
    failure_reason: str | None = None
    failure_code: str | None = None
    source_uri: str = ""
    blob_location: str | None = Field(default=None, description="blob store root the files live under")
    created_at: float = Field(default_factory=time.time)
    updated_at: float = Field(default_factory=time.time)
    labels: dict[str, str] = Field(default_factory=dict)
    description: str = ""
    golden: list[GoldenPrompt] = Field(default_factory=list, description=(
        "prompts with the answer this version must give; a rollout to it runs them first and at every step"))

    def visible_to(self, tenant: str | None) -> bool:
        return self.visibility == Visibility.public or (tenant is not None and tenant == self.owner_tenant)


class AdapterState(BaseModel):
    """Head of one adapter plus all its versions; the unit of a transactional update."""

    name: str
    owner_tenant: str | None = None
    active_version: int | None = None
    canary_version: int | None = None
    canary_weight: float = 0.0
    disabled: bool = False
    history: list[int] = Field(default_factory=list, description="previous active versions, most recent last")
    last_version: int = Field(default=0, ge=0, description="highest version number ever issued for this name; "
                                                           "never reused, even after deletes")
    versions: dict[int, AdapterRecord] = Field(default_factory=dict)
    rollout: Rollout | None = Field(None, description="the latest automatic rollout (registry.rollout), running or "
                                    "ended")

    def head(self) -> dict[str, Any]:
        """The serving-relevant part, as recorded in the audit log's before/after."""
        return {
            "active_version": self.active_version,
            "canary_version": self.canary_version,
            "canary_weight": self.canary_weight,
            "disabled": self.disabled,
            "history": list(self.history),
            "statuses": {str(v): r.status.value for v, r in sorted(self.versions.items())},
        } | ({"rollout": self.rollout.summary()} if self.rollout is not None else {})

    def rollout_running(self) -> bool:
        return self.rollout is not None and self.rollout.active

    def next_version(self) -> int:
        # Version numbers are engine and cache keys ("name@3"): a deleted number must never come back.
        return max(max(self.versions, default=0), self.last_version) + 1


class AuditEntry(BaseModel):
    seq: int = Field(description="global revision this mutation produced; audit order")
    ts: float
    actor: str
    action: str
    name: str = Field(description="adapter or base-model name the action concerns")
    version: int | None = None
    details: dict[str, Any] = Field(default_factory=dict)
    before: dict[str, Any] | None = None
    after: dict[str, Any] | None = None
