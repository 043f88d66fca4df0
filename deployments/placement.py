"""The placement controller on Serve, and the ingress's side of it.

`PlacementControllerDeployment` (one replica: the single writer) wraps
`router.controller.PlacementController`: ingresses report per-family request counts, LLM
replicas heartbeat and fetch their share of the plan, and it re-plans every `period_s`.
`PlacementReporter` lives in each ingress: it counts requests by adapter family, sends the
counts once a period, and keeps the latest view for `GET {admin_prefix}/v1/placement` and the
`loraserve_adapter_tier` gauge in `/metrics`.

The heartbeat also carries each replica's metrics report (`LLMServer.report()`); the controller keeps
the latest of every live replica and each ingress's reporter fetches them once a period for its
`/metrics`, so replica series stay current when no response is flowing.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any, Callable, Optional

from ray import serve

from router.controller import PlacementController, PlacementView
from router.placement import TIER_NAMES, PlacementConfig

__all__ = ["PlacementControllerDeployment", "PlacementReporter", "replica_share"]

logger = logging.getLogger(__name__)


def replica_share(view: PlacementView, replica_id: str) -> dict[str, Any]:
    """What one replica acts on: the plan version and family -> tier of everything homed on it
    (cold homes too: they rank above copies homed elsewhere when it evicts)."""
    return {"version": view.version,
            "tiers": {name: a["tier"] for name, a in view.adapters.items() if replica_id in a["homes"]}}


# No access log: every ingress and replica reports here each second, which would flood `serve run`'s output.
@serve.deployment(name="PlacementController", num_replicas=1, max_ongoing_requests=1000,
                  logging_config={"enable_access_log": False})
class PlacementControllerDeployment:
    async def __init__(self, placement: PlacementConfig, device_slots: int, host_slots: int, period_s: float = 1.0,
                       replica_ttl_s: float = 10.0):
        self.controller = PlacementController(placement, device_slots, host_slots,
                                              replica_ttl_s=replica_ttl_s)
        self.period_s = period_s
        self._reports: dict[str, dict[str, Any]] = {}  # replica id -> its latest LLMServer.report()
        self._last: Optional[PlacementView] = None
        self._plan()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            try:
                self._plan()
            except Exception:  # noqa: BLE001 - keep the last plan; try again next period
                logger.exception("placement plan failed")

    def _plan(self, left: Optional[str] = None) -> None:
        """Plan, and log each change of the replica set with the homes it moved (what an operator reads when a
        node is lost or Serve scales)."""
        view = self.controller.plan()
        before, self._last = self._last, view
        if before is None or before.replicas == view.replicas:
            return
        gone, new = set(before.replicas) - set(view.replicas), set(view.replicas) - set(before.replicas)
        moved = sorted(f for f, a in view.adapters.items() if a["tier"] != TIER_NAMES[-1]
                       and set(a["homes"]) != set(before.homes(f)))
        for rid in sorted(gone):
            how = "left (shutting down)" if rid == left else \
                f"missed heartbeats for {self.controller.replica_ttl_s:g} s (its node lost?)"
            logger.warning("placement: replica %s %s; plan v%d over %d replicas", rid, how, view.version,
                           len(view.replicas))
        for rid in sorted(new):
            logger.info("placement: replica %s joined; plan v%d over %d replicas", rid, view.version,
                        len(view.replicas))
        if moved:
            logger.info("placement: pinned/warm adapters with new homes: %s", ", ".join(moved[:20])
                        + (f" (+{len(moved) - 20} more)" if len(moved) > 20 else ""))

    async def report(self, counts: dict[str, float]) -> None:
        self.controller.report(counts)

    async def sync(self, replica_id: str, report: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        """A replica's heartbeat with its metrics report; -> its share of the current plan."""
        known = replica_id in self.controller.live_replicas()
        self.controller.heartbeat(replica_id)
        if report is not None:
            self._reports[replica_id] = report
        if not known:  # a new replica: plan now rather than a period later
            self._plan()
        return replica_share(self.controller.view, replica_id)

    async def leave(self, replica_id: str) -> None:
        """A replica that is shutting down (Serve scaled it in, or replaced it): out of the plan now, so its homes
        move to the others at once rather than when its heartbeat is `replica_ttl_s` late."""
        if replica_id in self.controller.live_replicas():
            self.controller.forget_replica(replica_id)
            self._reports.pop(replica_id, None)
            self._plan(left=replica_id)

    async def view(self) -> dict[str, Any]:
        return self.controller.view.to_json()

    async def reports(self) -> dict[str, dict[str, Any]]:
        """replica id -> latest metrics report, of the live replicas only."""
        live = set(self.controller.live_replicas())
        for gone in set(self._reports) - live:
            del self._reports[gone]
        return dict(self._reports)


class PlacementReporter:
    """Ingress side: count requests per adapter family, report them, keep the latest view."""

    def __init__(self, handle: Any, period_s: float = 1.0,
                 on_reports: Optional[Callable[[dict[str, dict[str, Any]]], None]] = None):
        self._handle, self.period_s = handle, period_s
        self._on_reports = on_reports  # replica id -> LLMServer.report(), once a period
        self._counts: Counter[str] = Counter()
        self.view: Optional[dict[str, Any]] = None
        self._task: Optional[asyncio.Task] = None

    def count(self, family: str) -> None:
        self._counts[family] += 1
        self._ensure_loop()

    def start(self) -> None:
        """Run the loop from now on (from the event loop), before any request is counted."""
        self._ensure_loop()

    async def refresh(self) -> dict[str, Any]:
        self._ensure_loop()
        self.view = await self._handle.view.remote()
        return self.view

    def _ensure_loop(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            counts, self._counts = dict(self._counts), Counter()
            try:
                if counts:
                    await self._handle.report.remote(counts)
                await self.refresh()
                if self._on_reports is not None:
                    # off the event loop: the callback may read the registry
                    await asyncio.to_thread(self._on_reports, await self._handle.reports.remote())
            except Exception:  # noqa: BLE001 - placement is advisory; serving goes on
                logger.warning("placement report failed", exc_info=True)
                self._counts.update(counts)

    def tiers(self) -> dict[str, int]:
        """adapter family -> tier number (0 pinned, 1 warm, 2 cold) of the latest view."""
        if not self.view:
            return {}
        return {name: TIER_NAMES.index(a["tier"]) for name, a in self.view["adapters"].items()}
