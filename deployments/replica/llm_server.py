"""One LLM replica: a request in, the engine's tokens out, and the parts that keep the replica current.

`LLMServer` is a plain class (engine and registry injected, so tests build it without Ray);
`deployments.replica.llm_deployment` wraps it as the Serve deployment `LLMServer`. Its parts, each in its module:
which adapters it offers (`adapters`), prompts and sampling per choice (`prompts`), the
change feed and the placement plan (`sync`), and what it reports (`report`: the engine's
stats, the one counter set).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

from deployments.config import AppConfig
from deployments.dependency_health import DependencyHealth
from deployments.replica.engine_streams import merge_streams
from deployments.data_plane.protocol import GenerateRequest
from deployments.registry_view import BLOBS, dependency_name
from deployments.replica.adapters import AdapterBlocked, AdapterLoadFailed, ReplicaAdapters
from deployments.replica.errors import error_chunk_of
from deployments.replica.placement import ReplicaPlacement
from deployments.replica.prompts import PromptShaper
from deployments.replica.report import EngineStatsReader, replica_report
from deployments.replica.sync import ReplicaSync
from deployments.replica.version_stats import VersionStats

__all__ = ["LLMServer"]

logger = logging.getLogger(__name__)


class LLMServer:
    def __init__(self, cfg: AppConfig, engine: Any, registry: Any, replica_id: str,
                 publish_residency: Optional[Callable[[list[str], dict], None]] = None,
                 clock: Callable[[], float] = time.time,
                 placement_sync: Optional[Callable[[str, dict], Awaitable[dict]]] = None):
        self.cfg, self.engine, self.registry, self.replica_id = cfg, engine, registry, replica_id
        self._publish, self._clock = publish_residency, clock
        # (replica id, this replica's report()) -> {"version", "tiers": {family: tier}}: the heartbeat that
        # fetches the plan also carries the replica's metrics to the ingresses, on a timer
        self._placement_sync = placement_sync
        self.health = DependencyHealth()
        self.placement = ReplicaPlacement(cfg.placement, clock)
        self.adapters = ReplicaAdapters(engine, registry, self.placement)
        self.stats = EngineStatsReader(engine)
        self.sync = ReplicaSync(engine, registry, self.adapters, self.placement, self.health, self.stats,
                                self._publish_residency)
        self.prompts = PromptShaper(engine.tokenizer, engine.max_model_len)
        self.versions = VersionStats(clock)  # per adapter version, for the rollout analysis (in report())
        self._ongoing = 0
        self._tasks: set[asyncio.Task] = set()
        self._unsubscribe: Optional[Callable[[], None]] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.engine.on_dead(self._on_engine_dead)
        await self.stats.read()
        self._spawn(self.stats.loop())
        # Follow the change feed as a named consumer: started again after a stop (say, during a promote),
        # this replica replays what it missed from its saved offset; the first time it starts from now.
        self._unsubscribe = self.registry.subscribe(self._on_registry_event, consumer=f"replica:{self.replica_id}")
        if self._placement_sync is not None:
            sync = lambda: self._placement_sync(self.replica_id, self.report())  # noqa: E731
            self._spawn(self.sync.placement_loop(sync, self.cfg.placement_period_s))

    async def stop(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
        for t in list(self._tasks):
            t.cancel()

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_registry_event(self, event: dict) -> None:
        # Called on the registry's subscriber thread.
        if self._loop is not None and isinstance(event, dict) and event.get("name"):
            self._loop.call_soon_threadsafe(self._spawn, self.sync.apply_change(event["name"]))

    def _on_engine_dead(self, error: Exception) -> None:
        """Called on the engine's thread: routers hear at once that this replica serves nothing any more (its
        health check fails too, and Serve replaces it)."""
        logger.error("engine core died: %s", error)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._publish_residency)

    def _publish_residency(self) -> None:
        # Tell Serve's controller at once (instead of at the next stats period), so routers see the
        # new resident adapter within a broadcast, not seconds later.
        if self._publish is not None:
            try:
                self._publish(self.adapters.known(), self.record_routing_stats())
            except Exception:  # noqa: BLE001 - advisory
                logger.debug("publishing residency failed", exc_info=True)

    # ------------------------------------------------------------------ requests
    async def generate(self, req: GenerateRequest) -> AsyncIterator[dict]:
        from engine_ext import EngineDeadError
        from registry import RegistryUnavailable

        started_at = self._clock()
        self._ongoing += 1
        track = self.versions.track(req.adapter_key, started_at, req.labels)
        try:
            hit = None
            if req.adapter_key is not None:
                try:
                    hit, load_s = await self.adapters.acquire(req.adapter_key, req.adapter_record)
                except (AdapterBlocked, AdapterLoadFailed, RegistryUnavailable, EngineDeadError) as e:
                    self._count_failure(req, e)
                    chunk = error_chunk_of(e, req)
                    track.chunk(chunk)
                    yield chunk
                    return
                self.adapters.note_request(req.adapter_key)
                if load_s:
                    self.health.ok(BLOBS)  # it fetched the files
                if not hit:
                    self._publish_residency()  # now that the engine holds it
            async for chunk in self._run_engine(req, started_at, hit):
                track.chunk(chunk)
                yield chunk
        except Exception:
            track.failed()
            raise
        finally:
            self._ongoing -= 1

    def _count_failure(self, req: GenerateRequest, err: Exception) -> None:
        """An adapter that could not be made servable: the store out of reach, or its files refused."""
        from registry import RegistryUnavailable

        if isinstance(err, RegistryUnavailable):  # the blob store (or the registry) is out of reach
            self.health.failed(dependency_name(err), err)
        elif isinstance(err, AdapterLoadFailed):
            logger.warning("loading adapter %s failed: %s", req.adapter_key, err)

    async def _run_engine(self, req: GenerateRequest, started_at: float, hit: Optional[bool]) -> AsyncIterator[dict]:
        try:
            prompts = await asyncio.to_thread(self.prompts.tokenize, req)
            choices = [(ids, self.prompts.params(req, len(ids), j)) for ids in prompts for j in range(req.n)]
        except Exception as e:  # noqa: BLE001 - the table says which are the request's fault; the rest re-raise
            yield error_chunk_of(e, req)
            return
        rid = req.request_id
        ids_of = (lambda i: rid) if len(choices) == 1 else (lambda i: f"{rid}/{i}")  # noqa: E731
        # The n samples of one prompt are consecutive choices: each after the first reuses the first's prompt KV.
        streams = [self.engine.generate(None, prompt_token_ids=ids, sampling_params=params, adapter_name=req.adapter_key,
                                        request_id=ids_of(i), share_prompt_with=ids_of(i - i % req.n) if i % req.n
                                        else None)
                   for i, (ids, params) in enumerate(choices)]
        firsts = await asyncio.gather(*(s.__anext__() for s in streams), return_exceptions=True)
        failed = next((e for e in firsts if isinstance(e, BaseException)), None)
        if failed is not None:
            await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
            yield error_chunk_of(failed, req)  # a request the engine refused when it was added; else a fault
            return
        yield {"type": "start", "replica": self.replica_id, "adapter_hit": hit, "started_at": started_at,
               "prompt_tokens": sum(len(ids) for ids in prompts), "num_running": self.stats.latest.get("num_running")}
        finish, tokens = {}, {}
        merged = merge_streams(streams, firsts)
        try:
            async for i, out in merged:
                if out.new_token_ids or out.delta_text:
                    yield {"type": "delta", "index": i, "text": out.delta_text, "num_tokens": len(out.new_token_ids),
                           "logprobs": self.prompts.logprob_entries(out)}
                if out.finished:
                    finish[i], tokens[i] = out.finish_reason or "stop", len(out.token_ids)
        except Exception as e:  # noqa: BLE001 - the table names what ends a stream with an error chunk (the engine
            yield error_chunk_of(e, req)  # core gone: a 503 to retry elsewhere); the rest re-raise
            return
        finally:
            await merged.aclose()  # the caller went away: abort every unfinished choice now
        yield {"type": "end", "finish_reason": finish[0], "completion_tokens": sum(tokens.values()),
               "finish_reasons": finish, "choice_tokens": tokens, "prompt_tokens": sum(len(ids) for ids in prompts),
               "snapshot": self.snapshot(req.adapter_key)}

    # ------------------------------------------------------------------ reporting
    def snapshot(self, key: Optional[str]) -> dict[str, Any]:
        """Replica gauges, the speculation's counters and this adapter's: what a response's last chunk carries."""
        return replica_report(self.stats.latest, self.stats.seq, [key] if key else [], len(self.adapters.known()))

    def report(self) -> dict[str, Any]:
        """`snapshot` of every adapter the engine has counters for: what the replica sends on a timer."""
        keys = sorted(self.stats.latest.get("adapters") or {})
        report = replica_report(self.stats.latest, self.stats.seq, keys, len(self.adapters.known()))
        report["versions"] = self.versions.report()
        return report

    def record_routing_stats(self) -> dict[str, Any]:
        """What `router.AffinityRouter` ranks on (Serve polls this every routing_stats_period_s)."""
        s = self.stats.latest
        known = self.adapters.known()
        known_set = set(known)
        return {
            "device_adapters": [a for a in s.get("device_adapters", ()) if a in known_set],
            "host_adapters": known,
            "num_running": s.get("num_running"),
            "num_waiting": s.get("num_waiting"),
            "free_kv_blocks": s.get("free_kv_blocks"),
            "num_ongoing": self._ongoing,
            "engine_alive": self.engine.is_alive(),  # False: routers send it nothing (router.ray_router)
            "disabled": self.adapters.blocked(),
            "reported_at": self._clock(),
            # families the placement homed here in host memory (pinned, warm); None: no controller
            "homes": None if self._placement_sync is None else self.placement.homes(),
            "placement_version": self.placement.share["version"],
            "pinned": sorted(self.placement.pinned),
        }
