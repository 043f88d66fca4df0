"""The state of one automatic rollout, kept in the adapter's head (`AdapterState.rollout`) so that it commits with
the canary weight it sets, in the same transaction, and outlives the process that drives it.

A rollout is `pending` (golden prompts not yet run on the canary), then `running` at step `step` with the weight
`policy.steps[step]`, then ends `promoted`, `rolled_back` (a failed check, with the reason and numbers) or
`aborted` (by an operator). Each step keeps the replicas' counters at its start (`baseline`): its analysis window
is what every replica counted since, so a restarted controller resumes the same window.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, Field

from registry.canary_policy import RolloutPolicy

__all__ = ["Rollout", "StepResult", "Check", "RolloutPhase", "ACTIVE_PHASES", "Baseline"]

RolloutPhase = Literal["pending", "running", "promoted", "rolled_back", "aborted"]
ACTIVE_PHASES = frozenset({"pending", "running"})
# replica id -> adapter key ("name@version") -> flat counters (canary_analysis.flat_counters)
Baseline = dict[str, dict[str, dict[str, float]]]


class Check(BaseModel):
    """One threshold applied to one window: the two values, the limit the canary's was held to."""

    name: str
    canary: Optional[float]
    stable: Optional[float]
    limit: Optional[float] = Field(description="the canary's bound (upper, or lower for *_min checks)")
    passed: bool


class StepResult(BaseModel):
    """How one step ended, with the numbers that decided it."""

    step: int = Field(description="-1: the golden prompts run before the first step")
    weight: float
    started_at: float
    ended_at: float
    verdict: Literal["passed", "failed", "golden_failed", "timed_out"]
    canary: dict[str, Any] = Field(default_factory=dict, description="the canary's window (analysis.summary)")
    stable: dict[str, Any] = Field(default_factory=dict)
    checks: list[Check] = Field(default_factory=list)
    not_compared: dict[str, str] = Field(default_factory=dict, description="check -> why the window could not "
                                         "apply it (no data: no drafts, no completed request)")
    golden: list[dict[str, Any]] = Field(default_factory=list, description="{prompt, passed, why} per golden prompt")


class Rollout(BaseModel):
    id: str
    version: int = Field(description="the canary version")
    stable_version: int = Field(description="the active version when the rollout started")
    policy: RolloutPolicy
    phase: RolloutPhase = "pending"
    step: int = Field(-1, description="index into policy.steps; -1 before the first")
    step_started_at: Optional[float] = None
    baseline: Baseline = Field(default_factory=dict)
    steps: list[StepResult] = Field(default_factory=list, description="every step that ended, oldest first")
    reason: Optional[str] = Field(None, description="why it ended (rolled back or aborted)")
    actor: str = ""
    started_at: float = 0.0
    ended_at: Optional[float] = None

    @property
    def active(self) -> bool:
        return self.phase in ACTIVE_PHASES

    @property
    def weight(self) -> float:
        return self.policy.steps[self.step] if self.phase == "running" and self.step >= 0 else 0.0

    def summary(self) -> dict[str, Any]:
        """What the audit log's before/after shows of it."""
        return {"id": self.id, "phase": self.phase, "step": self.step, "version": self.version}
