"""Lifecycle transitions as pure functions AdapterState -> AdapterState.

The head (active/canary pointers, disabled flag, history of previous actives) is the truth; each version's
status is derived from it by `restatus`, so the two can never disagree. Stores run these functions inside a
transaction (and re-run them on a retry), and the audit log records (action, args), so replaying the log
through `apply` reproduces the state.
"""

from __future__ import annotations

from typing import Any, Callable

from registry import rollout
from registry.errors import AdapterNotFound, LifecycleConflict, RegistryValidationError
from registry.records import SERVABLE_STATUSES, AdapterRecord, AdapterState, AdapterStatus

__all__ = ["promote", "canary", "rollback", "disable", "enable", "retire", "add_version", "delete_version",
           "restatus", "apply", "TRANSITIONS", "MAX_HISTORY"]

MAX_HISTORY = 32  # previous active versions kept for rollback


def restatus(state: AdapterState) -> AdapterState:
    versions = {}
    for v, rec in state.versions.items():
        if rec.status in SERVABLE_STATUSES:
            if v in (state.active_version, state.canary_version):
                status = AdapterStatus.disabled if state.disabled else (
                    AdapterStatus.active if v == state.active_version else AdapterStatus.canary)
            else:
                status = AdapterStatus.ready
            if status != rec.status:
                rec = rec.model_copy(update={"status": status})
        versions[v] = rec
    return state.model_copy(update={"versions": versions})


def _no_rollout(state: AdapterState, verb: str) -> None:
    """A running rollout owns the canary pointer and weight: a hand-made change would race its analysis."""
    if state.rollout_running():
        raise LifecycleConflict(f"cannot {verb} {state.name}: a rollout of v{state.rollout.version} is running; "
                                f"abort it first (lora-registry canary abort {state.name})", code="rollout_in_progress")


def _servable(state: AdapterState, version: int, verb: str) -> AdapterRecord:
    rec = state.versions.get(version)
    if rec is None:
        raise AdapterNotFound(f"adapter {state.name!r} has no version {version}")
    if rec.status not in SERVABLE_STATUSES:
        raise LifecycleConflict(f"cannot {verb} {state.name} v{version}: its status is {rec.status.value}")
    return rec


def promote(state: AdapterState, version: int) -> AdapterState:
    _no_rollout(state, "promote")
    _servable(state, version, "promote")
    if version == state.active_version:
        raise LifecycleConflict(f"{state.name} v{version} is already active")
    history = [h for h in state.history if h != version]
    if state.active_version is not None:
        history.append(state.active_version)
    canary_version = None if state.canary_version == version else state.canary_version
    return restatus(state.model_copy(update={
        "active_version": version, "history": history[-MAX_HISTORY:], "canary_version": canary_version,
        "canary_weight": state.canary_weight if canary_version is not None else 0.0}))


def canary(state: AdapterState, version: int, weight: float) -> AdapterState:
    if not (0.0 < weight < 1.0):
        raise RegistryValidationError(f"canary weight must be in (0, 1), got {weight}", code="bad_weight")
    _no_rollout(state, "canary")
    _servable(state, version, "canary")
    if state.active_version is None:
        raise LifecycleConflict(f"{state.name} has no active version to canary beside; promote one first")
    if version == state.active_version:
        raise LifecycleConflict(f"{state.name} v{version} is the active version; canary another one")
    return restatus(state.model_copy(update={"canary_version": version, "canary_weight": float(weight)}))


def rollback(state: AdapterState) -> AdapterState:
    """Back to the previous active version; an in-flight canary is cancelled (it was measured against the
    version being rolled away from). The rolled-away version stays `ready` and can be promoted again."""
    _no_rollout(state, "roll back")
    if state.active_version is None:
        raise LifecycleConflict(f"{state.name} has no active version to roll back")
    if not state.history:
        raise LifecycleConflict(f"{state.name} has no previous active version to roll back to")
    *history, previous = state.history
    return restatus(state.model_copy(update={
        "active_version": previous, "history": history, "canary_version": None, "canary_weight": 0.0}))


def disable(state: AdapterState) -> AdapterState:
    if state.disabled:
        raise LifecycleConflict(f"{state.name} is already disabled")
    return restatus(state.model_copy(update={"disabled": True}))


def enable(state: AdapterState) -> AdapterState:
    if not state.disabled:
        raise LifecycleConflict(f"{state.name} is not disabled")
    return restatus(state.model_copy(update={"disabled": False}))


def _not_rolling_out(state: AdapterState, version: int, verb: str) -> None:
    if state.rollout_running() and state.rollout.version == version:
        raise LifecycleConflict(f"cannot {verb} {state.name} v{version}: a rollout of it is running; abort it first",
                                code="rollout_in_progress")


def retire(state: AdapterState, version: int) -> AdapterState:
    _not_rolling_out(state, version, "retire")
    rec = state.versions.get(version)
    if rec is None:
        raise AdapterNotFound(f"adapter {state.name!r} has no version {version}")
    if version == state.active_version:
        raise LifecycleConflict(f"cannot retire {state.name} v{version}: it is active; promote or roll back first")
    if rec.status == AdapterStatus.retired:
        raise LifecycleConflict(f"{state.name} v{version} is already retired")
    is_canary = state.canary_version == version
    versions = {**state.versions, version: rec.model_copy(update={"status": AdapterStatus.retired})}
    return restatus(state.model_copy(update={
        "versions": versions, "history": [h for h in state.history if h != version],
        "canary_version": None if is_canary else state.canary_version,
        "canary_weight": 0.0 if is_canary else state.canary_weight}))


def add_version(state: AdapterState, record: AdapterRecord) -> AdapterState:
    """Insert or replace one version's record; the number is remembered so it is never issued again."""
    return restatus(state.model_copy(update={"versions": {**state.versions, record.version: record},
                                             "last_version": max(state.last_version, record.version)}))


def delete_version(state: AdapterState, version: int, force: bool = False) -> AdapterState:
    """Drop one version's record. The active version only with `force` (the adapter then has none active)."""
    if version not in state.versions:
        raise AdapterNotFound(f"adapter {state.name!r} has no version {version}")
    _not_rolling_out(state, version, "delete")
    if version == state.active_version and not force:
        raise LifecycleConflict(f"cannot delete {state.name} v{version}: it is active; promote or roll back first, "
                                f"or pass force=true")
    versions = {v: r for v, r in state.versions.items() if v != version}
    is_canary = state.canary_version == version
    return restatus(state.model_copy(update={
        "versions": versions, "history": [h for h in state.history if h != version],
        "active_version": None if version == state.active_version else state.active_version,
        "canary_version": None if is_canary else state.canary_version,
        "canary_weight": 0.0 if is_canary else state.canary_weight}))


# Explicit action -> transition table, used to replay audit entries ({"action", "details"}).
TRANSITIONS: dict[str, Callable[..., AdapterState]] = {
    "promote": lambda s, d: promote(s, d["version"]),
    "canary": lambda s, d: canary(s, d["version"], d["weight"]),
    "rollback": lambda s, d: rollback(s),
    "disable": lambda s, d: disable(s),
    "enable": lambda s, d: enable(s),
    "retire": lambda s, d: retire(s, d["version"]),
    "delete_version": lambda s, d: delete_version(s, d["version"], d.get("force", False)),
    "set_golden": lambda s, d: rollout.set_golden(s, d["version"], d["prompts"]),
    **rollout.TRANSITIONS,
}


def apply(state: AdapterState, action: str, details: dict[str, Any]) -> AdapterState:
    return TRANSITIONS[action](state, details)
