"""The rollout controller's logic: for each adapter with a rollout running, read the replicas' counters, judge
the step's window against the stable version, run the golden prompts, and commit the next step, the promotion
or the rollback, each with the numbers that decided it (they go into the audit log as the transition's details).

`RolloutRunner` holds no state a restart would lose: the rollout's step, its window's start and its baseline
counters are in the registry, and each decision commits only if the rollout is still at the step it was taken
at (registry.rollout). Its neighbours are injected: `reports()` -> replica id -> the replica's latest report
(the placement controller's collection of heartbeats), `generate(record, golden)` -> the version's greedy
answer to one golden prompt. `deployments.canary` runs it in the served app.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable, Mapping, Optional

from registry.canary_analysis import baseline, judge, not_compared, window, window_closed
from registry.canary_policy import GoldenPrompt, golden_failure
from registry.errors import AdapterNotFound, LifecycleConflict, RegistryError
from registry.records import AdapterRecord, AdapterState
from registry.rollout_state import Rollout, StepResult

__all__ = ["RolloutRunner", "run_golden", "keys_of"]

logger = logging.getLogger(__name__)

Reports = Mapping[str, Mapping[str, Any]]
Generate = Callable[[AdapterRecord, GoldenPrompt], Awaitable[str]]


def keys_of(state: AdapterState, r: Rollout) -> tuple[str, str]:
    """(canary key, stable key): the adapter keys ("name@version") the replicas count under."""
    return f"{state.name}@{r.version}", f"{state.name}@{r.stable_version}"


async def run_golden(generate: Generate, record: AdapterRecord, prompts: list[GoldenPrompt]) -> list[dict]:
    """Each golden prompt on `record`'s version -> {prompt, passed, why}; one that cannot run fails."""
    out = []
    for g in prompts:
        try:
            why = golden_failure(g, await generate(record, g))
        except Exception as e:  # noqa: BLE001 - a version that cannot answer fails its golden prompt
            why = f"could not run: {type(e).__name__}: {e}"
        out.append({"prompt": g.shown(), "passed": why is None, "why": why})
    return out


def _golden_reason(results: list[dict]) -> str:
    return "golden prompts failed: " + "; ".join(f"{r['prompt']!r}: {r['why']}" for r in results if not r["passed"])


def _metrics_reason(checks) -> str:
    return "metrics failed: " + "; ".join(
        f"{c.name} canary {c.canary:.4g} vs stable {c.stable:.4g} (limit {c.limit:.4g})" for c in checks if not c.passed)


class RolloutRunner:
    def __init__(self, registry: Any, reports: Callable[[], Awaitable[Reports]], generate: Generate,
                 clock: Callable[[], float] = time.time, actor: str = "canary-controller"):
        self.registry, self.reports, self.generate = registry, reports, generate
        self.clock, self.actor = clock, actor
        self.names: set[str] = set()  # adapters with a rollout running, as far as this runner has seen
        self.last: dict[str, Rollout] = {}  # the latest read of each rollout this runner drove (for metrics)

    # ------------------------------------------------------------------ which adapters
    async def scan(self) -> None:
        """Find every rollout running (at start-up: those a previous controller left mid-way)."""
        after = None
        while True:
            page = await asyncio.to_thread(self.registry.list_page, after, 500)
            self.names.update(s.name for s in page if s.rollout_running())
            if len(page) < 500:
                return
            after = page[-1].name

    def note(self, event: Mapping[str, Any]) -> None:
        """A change-feed event: a rollout started (or moved) on this adapter."""
        if str(event.get("action", "")).startswith("rollout_") and event.get("name"):
            self.names.add(event["name"])

    async def tick(self) -> dict[str, str]:
        """Advance every rollout that can move -> adapter -> what was done ("step 1", "promoted", ...)."""
        done = {}
        for name in sorted(self.names):
            try:
                action = await self.advance(name)
            except RegistryError as e:  # a store out of reach, a rollout moved by another writer: next tick
                logger.warning("rollout of %s: %s", name, e)
                continue
            if action:
                done[name] = action
        return done

    # ------------------------------------------------------------------ one rollout
    async def advance(self, name: str) -> Optional[str]:
        try:
            state = await asyncio.to_thread(self.registry.get, name)
        except AdapterNotFound:
            self.names.discard(name)
            return None
        r = state.rollout
        if r is not None:
            self.last[name] = r
        if r is None or not r.active:
            self.names.discard(name)
            return None
        canary = state.versions[r.version]
        if r.phase == "pending":
            return await self._first_step(state, r, canary)
        return await self._judge_step(state, r, canary)

    async def _commit(self, name: str, action: str, r: Rollout, details: dict) -> Optional[AdapterState]:
        details = {"id": r.id, "from_step": r.step, "version": r.version, **details}
        try:
            state = await asyncio.to_thread(self.registry.advance_rollout, name, action, details, actor=self.actor)
        except LifecycleConflict as e:  # decided on a stale read: the rollout moved meanwhile
            logger.info("rollout of %s not advanced: %s", name, e)
            return None
        self.last[name] = state.rollout
        return state

    async def _first_step(self, state: AdapterState, r: Rollout, canary: AdapterRecord) -> Optional[str]:
        now = self.clock()
        golden = await run_golden(self.generate, canary, canary.golden)
        result = StepResult(step=-1, weight=0.0, started_at=r.started_at, ended_at=self.clock(),
                            verdict="passed" if all(g["passed"] for g in golden) else "golden_failed",
                            golden=golden).model_dump(mode="json")
        if result["verdict"] != "passed":
            await self._commit(state.name, "rollout_rollback", r, {"ended_at": self.clock(), "result": result,
                                                                   "reason": _golden_reason(golden)})
            return "rolled_back"
        base = baseline(await self.reports(), keys_of(state, r))
        done = await self._commit(state.name, "rollout_step", r, {"step": 0, "started_at": now, "baseline": base,
                                                                  "result": result, "weight": r.policy.steps[0]})
        return "step 0" if done else None

    async def _judge_step(self, state: AdapterState, r: Rollout, canary: AdapterRecord) -> Optional[str]:
        now = self.clock()
        reports = await self.reports()
        ckey, skey = keys_of(state, r)
        c, s = window(reports, r.baseline, ckey), window(reports, r.baseline, skey)
        elapsed = now - (r.step_started_at or now)
        weight = r.policy.steps[r.step]
        result = dict(step=r.step, weight=weight, started_at=r.step_started_at or now, ended_at=now,
                      canary=c.summary(), stable=s.summary())
        if not window_closed(r.policy, c, s, elapsed):
            if elapsed < r.policy.step_timeout_s:
                return None
            drafts = (f", {int(c.get('drafted'))} and {int(s.get('drafted'))} drafted tokens (each needs "
                      f"{r.policy.thresholds.min_drafted_tokens})" if r.policy.thresholds.require_draft_acceptance
                      else "")
            reason = (f"step {r.step}'s window did not fill in {r.policy.step_timeout_s:g} s: {int(c.requests)} "
                      f"canary and {int(s.requests)} stable requests{drafts}; the canary could not be judged")
            await self._commit(state.name, "rollout_rollback", r, {
                "ended_at": now, "reason": reason,
                "result": StepResult(verdict="timed_out", **result).model_dump(mode="json")})
            return "rolled_back"
        checks = judge(r.policy.thresholds, c, s)
        result["not_compared"] = not_compared(r.policy.thresholds, c, s, checks)
        if not all(ch.passed for ch in checks):
            await self._commit(state.name, "rollout_rollback", r, {
                "ended_at": now, "reason": _metrics_reason(checks),
                "result": StepResult(verdict="failed", checks=checks, **result).model_dump(mode="json")})
            return "rolled_back"
        golden = await run_golden(self.generate, canary, canary.golden)
        if not all(g["passed"] for g in golden):
            await self._commit(state.name, "rollout_rollback", r, {
                "ended_at": self.clock(), "reason": _golden_reason(golden),
                "result": StepResult(verdict="golden_failed", checks=checks, golden=golden, **result)
                .model_dump(mode="json")})
            return "rolled_back"
        passed = StepResult(verdict="passed", checks=checks, golden=golden, **result).model_dump(mode="json")
        if r.step == len(r.policy.steps) - 1:
            done = await self._commit(state.name, "rollout_promote", r, {"ended_at": self.clock(), "result": passed})
            return "promoted" if done else None
        nxt = r.step + 1
        done = await self._commit(state.name, "rollout_step", r, {
            "step": nxt, "started_at": self.clock(), "baseline": baseline(reports, (ckey, skey)), "result": passed,
            "weight": r.policy.steps[nxt]})
        return f"step {nxt}" if done else None
