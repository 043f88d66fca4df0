"""What a replica does when the registry or the placement plan changes, off the request path.

- Change feed (promote, rollback, canary, disable, delete of one adapter): withdraw versions no longer served,
  refuse a disabled adapter, load the version about to take traffic where an older one was resident, and remove
  this host's materialized copies of deleted versions.
- Placement (each period, from the controller's plan): load the active version of every pinned and warm
  family homed here (pinned ones also into a device slot, by a one-token request the scheduler batches like
  any other, and pinned in the engine), and unpin what left the pinned tier.

Loads run on worker threads, so decoding never waits on them. A registry or controller out of reach skips the
work (a change is retried) with one log line per outage (DependencyHealth), not one per attempt.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from deployments.dependency_health import DependencyHealth
from deployments.registry_view import METADATA, dependency_name
from deployments.replica.adapters import ReplicaAdapters
from deployments.replica.placement import ReplicaPlacement
from deployments.replica.report import EngineStatsReader
from router.keys import AdapterKey
from router.placement import TIER_PINNED

__all__ = ["ReplicaSync"]

logger = logging.getLogger(__name__)
CONTROLLER = "placement controller"


class ReplicaSync:
    def __init__(self, engine: Any, registry: Any, adapters: ReplicaAdapters, placement: ReplicaPlacement,
                 health: DependencyHealth, stats: EngineStatsReader, publish: Callable[[], None],
                 change_retry_s: float = 1.0):
        self.engine, self.registry, self.adapters, self.placement = engine, registry, adapters, placement
        self.health, self.stats, self._publish = health, stats, publish
        self._change_retry_s = change_retry_s

    async def _state(self, name: str):
        """The adapter's registry state; None when it is gone, or while the registry is out of reach."""
        from registry import AdapterNotFound, RegistryUnavailable

        try:
            state = await asyncio.to_thread(self.registry.get, name)
        except AdapterNotFound:
            state = None
        except RegistryUnavailable as e:
            self.health.failed(METADATA, e)
            raise
        self.health.ok(METADATA)
        return state

    async def _prefetch(self, key: str, cause: str) -> bool:
        from registry import RegistryUnavailable

        try:
            await self.adapters.acquire(key, cause=cause)
        except RegistryUnavailable as e:  # tried again next period; one log line per outage
            self.health.failed(dependency_name(e), e)
            return False
        except Exception as e:  # noqa: BLE001 - a failed prefetch surfaces on the next request for it
            logger.warning("prefetch of %s failed: %s: %s", key, type(e).__name__, e)
            return False
        return True

    # ------------------------------------------------------------------ change feed
    async def apply_change(self, name: str, attempts: int = 300) -> None:
        """Promote/rollback/canary/disable/delete of `name`; retried every `change_retry_s` while the registry is out
        of reach (up to `attempts` times)."""
        from registry import RegistryUnavailable

        for _ in range(attempts):
            try:
                state = await self._state(name)
                break
            except RegistryUnavailable:
                await asyncio.sleep(self._change_retry_s)
        else:
            return
        # the files of versions that are gone leave this host's disk at once (the engine holds what it loaded)
        await asyncio.to_thread(self.registry.drop_materialized, name, set(state.versions) if state else set())
        if state is None:
            self.adapters.retire(name)
            self._publish()
            return
        if state.disabled:
            self.adapters.block(name)
            self._publish()
            return
        self.adapters.unblock(name)
        versions = [v for v in (state.active_version, state.canary_version) if v is not None]
        serving = frozenset(str(AdapterKey(name, v)) for v in versions)
        was_resident = name in self.adapters.families()
        self.adapters.retire(name, keep=serving)
        for key in sorted(serving) if was_resident else ():  # warm what takes traffic where an older one lived
            if not self.adapters.is_known(key):
                await self._prefetch(key, "change")
        self._publish()

    # ------------------------------------------------------------------ placement
    async def placement_loop(self, sync: Callable[[], Awaitable[dict]], period_s: float) -> None:
        while True:
            try:
                share = await sync()
            except Exception as e:  # noqa: BLE001 - advisory: keep serving on the last plan
                self.health.failed(CONTROLLER, e)
            else:
                self.health.ok(CONTROLLER)
                changed, self.placement.share = share != self.placement.share, share
                if changed:  # tiers and homes order the engine's evictions
                    self.adapters.rerank()
                await self.apply_placement()
            await asyncio.sleep(period_s)

    async def apply_placement(self) -> None:
        """Load the pinned and warm homes, pin the pinned ones (on the device too), unpin the demoted."""
        from registry import RegistryUnavailable

        wanted_pins: set[str] = set()
        for family, tier in self.placement.wanted():
            try:
                state = await self._state(family)
            except RegistryUnavailable:
                return  # keep the current pins until the registry answers again
            if state is None or state.disabled or state.active_version is None:
                continue
            key = str(AdapterKey(family, state.active_version))
            if not self.adapters.is_known(key):
                if not await self._prefetch(key, "placement"):
                    continue
                self._publish()
            if tier == TIER_PINNED:
                wanted_pins.add(key)
        for key in self.placement.pinned - wanted_pins:
            self.engine.pin_adapter(key, False)
        for key in wanted_pins:
            self.engine.pin_adapter(key, True)
            if key not in self.stats.latest.get("device_adapters", ()):
                await self._warm_device(key)
                await self.stats.read()
        self.placement.pinned = wanted_pins

    async def _warm_device(self, key: str) -> None:
        """Put `key` in a device slot now: a one-token request on it (the scheduler activates it beside the
        running batch, as for any request)."""
        from engine_ext import SamplingParams

        stream = self.engine.generate(None, prompt_token_ids=[1], sampling_params=SamplingParams(max_tokens=1),
                                      adapter_name=key, request_id=f"warm-{key}-{time.monotonic_ns()}")
        try:
            async for _ in stream:
                pass
        finally:
            await stream.aclose()
