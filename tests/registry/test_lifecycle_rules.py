"""Pure lifecycle transitions: table tests on AdapterState, no store involved."""

from __future__ import annotations

import pytest

from registry import lifecycle
from registry.errors import AdapterNotFound, LifecycleConflict, RegistryValidationError
from registry.records import AdapterRecord, AdapterState, AdapterStatus


def state(*statuses: str, active=None, canary=None, weight=0.0, history=(), disabled=False) -> AdapterState:
    versions = {i + 1: AdapterRecord(name="n", version=i + 1, base_model="b", status=AdapterStatus(s))
                for i, s in enumerate(statuses)}
    return lifecycle.restatus(AdapterState(name="n", versions=versions, active_version=active, canary_version=canary,
                                           canary_weight=weight, history=list(history), disabled=disabled))


def statuses(s: AdapterState) -> list[str]:
    return [r.status.value for _, r in sorted(s.versions.items())]


@pytest.mark.parametrize("before,op,head,expect", [
    # promote the first version, then a second: previous active goes to history and back to ready
    (state("ready", "ready"), lambda s: lifecycle.promote(s, 1), (1, None, []), ["active", "ready"]),
    (state("ready", "ready", active=1), lambda s: lifecycle.promote(s, 2), (2, None, [1]), ["ready", "active"]),
    # promoting the canary ends the canary
    (state("ready", "ready", active=1, canary=2, weight=0.3), lambda s: lifecycle.promote(s, 2), (2, None, [1]),
     ["ready", "active"]),
    (state("ready", "ready", active=1), lambda s: lifecycle.canary(s, 2, 0.25), (1, 2, []), ["active", "canary"]),
    # rollback restores the previous active and cancels a canary
    (state("ready", "ready", "ready", active=2, canary=3, weight=0.5, history=[1]), lifecycle.rollback, (1, None, []),
     ["active", "ready", "ready"]),
    # disabled: serving versions show as disabled; enable restores them
    (state("ready", "ready", active=1, canary=2, weight=0.1), lifecycle.disable, (1, 2, []), ["disabled", "disabled"]),
    (state("ready", "ready", active=1, canary=2, weight=0.1, disabled=True), lifecycle.enable, (1, 2, []),
     ["active", "canary"]),
    # retiring a version drops it from history and from a canary
    (state("ready", "ready", "ready", active=3, canary=2, weight=0.2, history=[1]), lambda s: lifecycle.retire(s, 1),
     (3, 2, []), ["retired", "canary", "active"]),
    (state("ready", "ready", active=1, canary=2, weight=0.2), lambda s: lifecycle.retire(s, 2), (1, None, []),
     ["active", "retired"]),
    (state("failed", "ready", active=2), lambda s: lifecycle.retire(s, 1), (2, None, []), ["retired", "active"]),
])
def test_transition_table(before, op, head, expect):
    after = op(before)
    assert (after.active_version, after.canary_version, after.history) == head
    assert statuses(after) == expect
    assert before != after  # transitions are pure: the input object is not modified in place


@pytest.mark.parametrize("before,op,exc,words", [
    (state("failed"), lambda s: lifecycle.promote(s, 1), LifecycleConflict, "failed"),
    (state("ready"), lambda s: lifecycle.promote(s, 7), AdapterNotFound, "no version 7"),
    (state("ready", active=1), lambda s: lifecycle.promote(s, 1), LifecycleConflict, "already active"),
    (state("ready", "ready"), lambda s: lifecycle.canary(s, 2, 0.5), LifecycleConflict, "no active version"),
    (state("ready", "ready", active=1), lambda s: lifecycle.canary(s, 2, 1.5), RegistryValidationError, "weight"),
    (state("ready", "ready", active=1), lambda s: lifecycle.canary(s, 1, 0.5), LifecycleConflict, "active version"),
    (state("ready", active=1), lifecycle.rollback, LifecycleConflict, "no previous"),
    (state("ready"), lifecycle.rollback, LifecycleConflict, "no active"),
    (state("ready", active=1, disabled=True), lifecycle.disable, LifecycleConflict, "already disabled"),
    (state("ready", active=1), lifecycle.enable, LifecycleConflict, "not disabled"),
    (state("ready", active=1), lambda s: lifecycle.retire(s, 1), LifecycleConflict, "active"),
    (state("retired", "ready", active=2), lambda s: lifecycle.retire(s, 1), LifecycleConflict, "already retired"),
    (state("retired", "ready", active=2), lambda s: lifecycle.promote(s, 1), LifecycleConflict, "retired"),
    (state("staged", "ready", active=2), lambda s: lifecycle.canary(s, 1, 0.5), LifecycleConflict, "staged"),
])
def test_refused_transitions(before, op, exc, words):
    with pytest.raises(exc, match=words):
        op(before)


def test_history_is_bounded():
    s = state(*["ready"] * (lifecycle.MAX_HISTORY + 5))
    for v in range(1, lifecycle.MAX_HISTORY + 6):
        s = lifecycle.promote(s, v)
    assert len(s.history) == lifecycle.MAX_HISTORY and s.history[-1] == lifecycle.MAX_HISTORY + 4
