"""Rollout transitions as pure functions AdapterState -> AdapterState, like the rest of the lifecycle (whose
`TRANSITIONS` table holds them too, so replaying the audit log reproduces a rollout).

Each transition the controller makes names the rollout (`id`) and the step it saw (`from_step`): the store runs
the function inside its transaction, so a decision taken on a stale read (a second controller, or one restarted
mid-decision) is refused, never applied twice. That is what keeps a step from being skipped or a promotion from
happening twice.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from registry.canary_policy import MAX_GOLDEN, GoldenPrompt, RolloutPolicy
from registry.errors import AdapterNotFound, LifecycleConflict, RegistryValidationError
from registry.records import SERVABLE_STATUSES, AdapterState
from registry.rollout_state import Rollout, StepResult

__all__ = ["set_golden", "start", "step", "promote", "rollback", "abort", "TRANSITIONS", "parse_policy",
           "parse_golden"]


def _invalid(what: str, err: ValidationError) -> RegistryValidationError:
    problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or what}: {str(e['msg']).removeprefix('Value error, ')}"
                         for e in err.errors())
    return RegistryValidationError(f"invalid {what}: {problems}", code=f"invalid_{what.replace(' ', '_')}")


def parse_policy(policy: Any) -> RolloutPolicy:
    """A policy as given (dict, or None for the defaults) -> RolloutPolicy, or a 422 naming each problem."""
    try:
        return RolloutPolicy.model_validate(policy or {})
    except ValidationError as e:
        raise _invalid("policy", e) from None


def parse_golden(prompts: Any) -> list[GoldenPrompt]:
    if not isinstance(prompts, list) or len(prompts) > MAX_GOLDEN:
        raise RegistryValidationError(f"golden prompts are a list of at most {MAX_GOLDEN}", code="invalid_golden")
    try:
        return [GoldenPrompt.model_validate(p) for p in prompts]
    except ValidationError as e:
        raise _invalid("golden", e) from None


def _restatus(state: AdapterState) -> AdapterState:
    from registry.lifecycle import restatus

    return restatus(state)


def set_golden(state: AdapterState, version: int, prompts: list[dict[str, Any]]) -> AdapterState:
    rec = state.versions.get(version)
    if rec is None:
        raise AdapterNotFound(f"adapter {state.name!r} has no version {version}")
    if state.rollout_running() and state.rollout.version == version:
        raise LifecycleConflict(f"{state.name} v{version} is being rolled out: its golden prompts are what it is "
                                f"being judged on; abort the rollout first", code="rollout_in_progress")
    golden = parse_golden(prompts)
    return state.model_copy(update={"versions": {**state.versions, version: rec.model_copy(update={"golden": golden})}})


def start(state: AdapterState, d: dict[str, Any]) -> AdapterState:
    """A rollout of `d["version"]` against the active version, pending its golden prompts (no traffic yet)."""
    version = d["version"]
    if state.rollout_running():
        raise LifecycleConflict(f"{state.name} already has a rollout running (v{state.rollout.version}, id "
                                f"{state.rollout.id}); abort it first", code="rollout_in_progress")
    if state.canary_version is not None:
        raise LifecycleConflict(f"{state.name} has a canary set by hand (v{state.canary_version}); promote or roll "
                                f"it back first", code="canary_in_progress")
    rec = state.versions.get(version)
    if rec is None:
        raise AdapterNotFound(f"adapter {state.name!r} has no version {version}")
    if rec.status not in SERVABLE_STATUSES:
        raise LifecycleConflict(f"cannot roll out {state.name} v{version}: its status is {rec.status.value}")
    if state.active_version is None:
        raise LifecycleConflict(f"{state.name} has no active version to compare a canary with; promote one first")
    if version == state.active_version:
        raise LifecycleConflict(f"{state.name} v{version} is the active version; roll out another one")
    rollout = Rollout(id=d["id"], version=version, stable_version=state.active_version,
                      policy=parse_policy(d.get("policy")), actor=d.get("actor", ""), started_at=d["started_at"])
    return state.model_copy(update={"rollout": rollout})


def _current(state: AdapterState, d: dict[str, Any]) -> Rollout:
    """The rollout `d` was decided on, still where the decision saw it; else a conflict (nothing changes)."""
    r = state.rollout
    if r is None or r.id != d["id"] or not r.active or r.step != d["from_step"]:
        where = "none" if r is None else f"{r.id} {r.phase} at step {r.step}"
        raise LifecycleConflict(f"{state.name}: rollout {d['id']} at step {d['from_step']} is not the current one "
                                f"({where})", code="rollout_moved")
    if state.active_version != r.stable_version:
        raise LifecycleConflict(f"{state.name}: the active version changed under rollout {r.id}", code="rollout_moved")
    return r


def _with_result(r: Rollout, d: dict[str, Any]) -> list[StepResult]:
    result = d.get("result")
    return [*r.steps, StepResult.model_validate(result)] if result else list(r.steps)


def step(state: AdapterState, d: dict[str, Any]) -> AdapterState:
    """To step `d["step"]` (the next one): its weight on the canary, its window starting at `d["baseline"]`."""
    r = _current(state, d)
    if d["step"] != r.step + 1 or d["step"] >= len(r.policy.steps):
        raise LifecycleConflict(f"{state.name}: rollout {r.id} cannot go from step {r.step} to {d['step']}",
                                code="rollout_moved")
    rollout = r.model_copy(update={"phase": "running", "step": d["step"], "step_started_at": d["started_at"],
                                   "baseline": d["baseline"], "steps": _with_result(r, d)})
    return _restatus(state.model_copy(update={"rollout": rollout, "canary_version": r.version,
                                              "canary_weight": r.policy.steps[d["step"]]}))


def _ended(state: AdapterState, r: Rollout, d: dict[str, Any], phase: str) -> AdapterState:
    rollout = r.model_copy(update={"phase": phase, "ended_at": d["ended_at"], "reason": d.get("reason"),
                                   "baseline": {}, "steps": _with_result(r, d)})
    keep = state.canary_version is not None and state.canary_version != r.version
    return _restatus(state.model_copy(update={
        "rollout": rollout, "canary_version": state.canary_version if keep else None,
        "canary_weight": state.canary_weight if keep else 0.0}))


def promote(state: AdapterState, d: dict[str, Any]) -> AdapterState:
    """The last step passed: the canary becomes the active version (the stable one goes into the history)."""
    from registry.lifecycle import promote as make_active

    r = _current(state, d)
    if r.step != len(r.policy.steps) - 1:
        raise LifecycleConflict(f"{state.name}: rollout {r.id} is at step {r.step} of {len(r.policy.steps)}; only "
                                f"the last step promotes", code="rollout_moved")
    return make_active(_ended(state, r, d, "promoted"), r.version)


def rollback(state: AdapterState, d: dict[str, Any]) -> AdapterState:
    """A check failed: the canary gets no more traffic; the stable version serves everything."""
    return _ended(state, _current(state, d), d, "rolled_back")


def abort(state: AdapterState, d: dict[str, Any]) -> AdapterState:
    """An operator ends the rollout: as a rollback, but not a verdict on the canary."""
    r = state.rollout
    if r is None or not r.active:
        raise LifecycleConflict(f"{state.name} has no rollout running", code="no_rollout")
    return _ended(state, r, d, "aborted")


TRANSITIONS = {
    "rollout_start": start,
    "rollout_step": step,
    "rollout_promote": promote,
    "rollout_rollback": rollback,
    "rollout_abort": abort,
}
