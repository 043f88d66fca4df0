"""Automatic rollouts in the served app: the `CanaryController` deployment (one replica, the single writer of
rollout decisions), the golden-prompt client it and the control plane share, and the `/metrics` series of the
rollouts' state.

The controller runs `registry.canary_runner.RolloutRunner` every `canary.period_s`: the replicas' counters come
from the placement controller's collection of their heartbeats (every live LLM replica's latest report), so a
version served on several replicas is judged on all of them; golden prompts go to the LLM replicas through a
handle, greedy, labelled so that the replicas leave them out of the analysis. Everything the runner decides is in
the registry, so a controller that is killed and restarted by Serve resumes each rollout at its step.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, Callable, Iterable, Optional

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from ray import serve

from deployments.config import AppConfig
from deployments.data_plane.protocol import GenerateRequest
from deployments.replica.version_stats import GOLDEN_LABEL

__all__ = ["CanaryControllerDeployment", "GoldenClient", "RolloutReporter", "PHASES"]

logger = logging.getLogger(__name__)

PHASES = ("pending", "running", "promoted", "rolled_back", "aborted")


class GoldenClient:
    """A version's greedy answer to a golden prompt, through an `LLMClient` (deployments.data_plane.ingress)."""

    def __init__(self, llm: Any, timeout_s: float = 60.0):
        self._llm, self._timeout_s = llm, timeout_s

    async def answer(self, record: Any, golden: Any) -> str:
        inputs = ({"prompt": golden.prompt} if golden.prompt is not None else
                  {"messages": [m.model_dump() for m in golden.messages]})
        req = GenerateRequest(f"golden-{uuid.uuid4().hex[:16]}", f"{record.name}@{record.version}",
                              {"max_tokens": golden.max_tokens, "temperature": 0.0}, labels=dict([GOLDEN_LABEL]),
                              adapter_record=record, **inputs)

        async def collect() -> str:
            parts = []
            async for chunk in self._llm.stream(req):
                if chunk["type"] == "error":
                    raise RuntimeError(f"{chunk['code']}: {chunk['message']}")
                if chunk["type"] == "delta" and chunk.get("index", 0) == 0:
                    parts.append(chunk["text"])
            return "".join(parts)

        return await asyncio.wait_for(collect(), self._timeout_s)

    def checker(self, loop: asyncio.AbstractEventLoop) -> Callable[[Any, list], list[dict]]:
        """`check(record, prompts)` for the control plane's sync routes (a worker thread): runs on `loop`."""
        from registry.canary_runner import run_golden

        def check(record: Any, prompts: list) -> list[dict]:
            future = asyncio.run_coroutine_threadsafe(run_golden(self.answer, record, prompts), loop)
            return future.result(timeout=self._timeout_s * max(1, len(prompts)) + 5)

        return check


def _summary(name: str, r: Any) -> dict[str, Any]:
    return {"adapter": name, "version": r.version, "stable_version": r.stable_version, "phase": r.phase,
            "step": r.step, "steps": len(r.policy.steps), "weight": r.weight}


# No access log: each ingress asks it for the summary once a period.
@serve.deployment(name="CanaryController", num_replicas=1, max_ongoing_requests=100, health_check_period_s=1.0,
                  logging_config={"enable_access_log": False})
class CanaryControllerDeployment:
    async def __init__(self, config: dict[str, Any], llm: Any, placement: Any):
        from deployments.bootstrap import make_registry
        from deployments.data_plane.ingress import ServeLLMClient
        from registry.canary_runner import RolloutRunner

        cfg = AppConfig.model_validate(config)
        self.registry = make_registry(cfg)
        golden = GoldenClient(ServeLLMClient(llm), cfg.canary.golden_timeout_s)
        self.runner = RolloutRunner(self.registry, reports=lambda: placement.reports.remote(),
                                    generate=golden.answer)
        loop = asyncio.get_running_loop()
        self._unsubscribe = self.registry.subscribe(lambda e: loop.call_soon_threadsafe(self.runner.note, e))
        await self.runner.scan()  # rollouts a previous controller left mid-way resume at their step
        self.period_s = cfg.canary.period_s
        self._task = loop.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            try:
                done = await self.runner.tick()
            except Exception:  # noqa: BLE001 - the rollouts' state is in the registry: try again next period
                logger.exception("rollout tick failed")
                continue
            for name, action in done.items():
                logger.info("rollout of %s: %s", name, action)

    async def summary(self) -> list[dict[str, Any]]:
        """The rollouts this controller drove or saw, their latest state."""
        return [_summary(name, r) for name, r in sorted(self.runner.last.items())]

    def check_health(self) -> None:
        if self._task.done():
            raise RuntimeError("the rollout loop ended")


class RolloutReporter(Collector):
    """The ingress's `/metrics` view of the rollouts: the controller's summary, fetched once a period.

    loraserve_rollout_phase{adapter,version,phase} 1 for the phase the rollout is in, 0 for the others;
    loraserve_rollout_step{adapter,version} the step's index (-1 before the first); loraserve_rollout_canary_weight
    {adapter,version} the share of traffic the canary gets from the rollout (0 once it ended)."""

    def __init__(self, handle: Any, period_s: float, shown: Callable[[], Callable[[str], bool]]):
        self._handle, self._period_s, self._shown = handle, period_s, shown
        self._latest: list[dict[str, Any]] = []
        self._task: Optional[asyncio.Task] = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            try:
                self._latest = await self._handle.summary.remote()
            except Exception:  # noqa: BLE001 - metrics are advisory
                logger.debug("rollout summary failed", exc_info=True)
            await asyncio.sleep(self._period_s)

    def collect(self) -> Iterable:
        shown = self._shown()
        rows = [r for r in self._latest if shown(r["adapter"])]
        phase = GaugeMetricFamily("loraserve_rollout_phase", "Phase of the adapter's latest automatic rollout "
                                  "(1 for the phase it is in)", labels=["adapter", "version", "phase"])
        step = GaugeMetricFamily("loraserve_rollout_step", "Traffic step the rollout is at (-1: golden prompts "
                                 "before the first)", labels=["adapter", "version"])
        weight = GaugeMetricFamily("loraserve_rollout_canary_weight", "Share of the adapter's requests the "
                                   "rollout gives its canary version", labels=["adapter", "version"])
        for r in rows:
            labels = [r["adapter"], str(r["version"])]
            for p in PHASES:
                phase.add_metric([*labels, p], 1.0 if r["phase"] == p else 0.0)
            step.add_metric(labels, float(r["step"]))
            weight.add_metric(labels, float(r["weight"]))
        yield from (phase, step, weight)
