"""What a replica tells the rest of the app, all from one counter set: the engine's `stats()`.

`EngineStatsReader` keeps the latest read (off the event loop: `stats()` takes the lock `step()` holds) and
numbers the reads, so the ingress never lets an older report take a counter back. `replica_report` turns a
read into the report that rides on a response's last chunk and on the timer heartbeat (deployments.metrics
exports it); the per-adapter fields are the engine's own counters, renamed where the series name differs.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Iterable

__all__ = ["EngineStatsReader", "replica_report", "ADAPTER_FIELDS"]

logger = logging.getLogger(__name__)

# report field -> the engine's per-adapter counter it carries
ADAPTER_FIELDS = {"requests": "requests", "hits": "hits", "device_loads": "loads", "loads": "disk_loads",
                  "load_seconds": "disk_load_seconds", "tokens": "tokens", "acceptance_rate": "acceptance_rate",
                  "drafted_tokens": "drafted_tokens", "accepted_tokens": "accepted_tokens"}
_SPEC_FIELDS = ("cycles", "plain_steps", "joined", "ridden_prompts", "paced_prompts")
# report["prefix_cache"] fields: the engine's prefix-cache counters (lookups in tokens) and gauges
_PREFIX_FIELDS = ("queries", "hits", "cached_blocks", "evictions")


class EngineStatsReader:
    def __init__(self, engine: Any):
        self._engine = engine
        self.latest: dict[str, Any] = {}
        self.seq = 0  # bumped on every read: orders this replica's reports

    async def read(self) -> dict[str, Any]:
        self.latest, self.seq = await asyncio.to_thread(self._engine.stats), self.seq + 1
        return self.latest

    async def loop(self, period_s: float = 0.5) -> None:
        from engine_ext import EngineDeadError

        while True:
            await asyncio.sleep(period_s)
            try:
                await self.read()
            except EngineDeadError:  # the replica is being replaced: nothing more to read
                return
            except Exception:  # noqa: BLE001 - stats are advisory
                logger.exception("engine.stats() failed")


def replica_report(stats: dict[str, Any], seq: int, keys: Iterable[str], host_adapters: int) -> dict[str, Any]:
    """Replica gauges, the speculation's counters and the engine's counters of the adapters `keys`."""
    out: dict[str, Any] = {k: stats.get(k) for k in ("num_running", "num_waiting", "free_kv_blocks")}
    out["seq"] = seq
    out["device_adapters"] = len(stats.get("device_adapters", ()))
    out["host_adapters"] = host_adapters
    spec = stats.get("speculative")
    if spec is not None:
        out["speculative"] = {k: spec.get(k) for k in _SPEC_FIELDS} | {"gate_decisions": dict(spec["gate_decisions"])}
    prefix = stats.get("prefix_cache")
    if prefix is not None:
        out["prefix_cache"] = {k: prefix.get(k) for k in _PREFIX_FIELDS} | {"base": dict(prefix["base"])}
    engine_adapters = stats.get("adapters") or {}
    prefix_adapters = (prefix or {}).get("adapters") or {}
    keys = list(keys)
    if keys:
        out["adapters"] = {key: {field: engine_adapters.get(key, {}).get(name) for field, name in ADAPTER_FIELDS.items()}
                           for key in keys}
        if prefix is not None:  # (a key with no lookup yet counts zero)
            for key in keys:
                looked = prefix_adapters.get(key, {})
                out["adapters"][key] |= {"prefix_queries": looked.get("queries", 0),
                                         "prefix_hits": looked.get("hits", 0)}
    return out
