"""The Serve deployment `LLMServer`: builds the engine and registry inside the replica and
delegates to `deployments.replica.llm_server.LLMServer`."""

from __future__ import annotations

import asyncio
import gc
import os
import time
from typing import Any, AsyncIterator

from ray import serve

from deployments import warm_start
from deployments.config import AppConfig
from deployments.engine_settings import engine_config
from deployments.replica.llm_server import LLMServer
from deployments.data_plane.protocol import GenerateRequest, PromptBound
from deployments.serve_internals import residency_publisher

__all__ = ["LLMDeployment"]


@serve.deployment(name="LLMServer")
class LLMDeployment:
    async def __init__(self, config: dict[str, Any], placement: Any = None):
        # Wall-clock marks of this replica's start-up (describe()["startup"]): where a replacement's time goes.
        marks = {"process_started": _process_started_at(), "constructor": time.time(),
                 "warm_start": warm_start.forked_at() is not None}
        import torch

        from deployments.bootstrap import make_registry, replica_model_dir
        from engine_ext import AsyncLLMEngine

        marks["imports_done"] = time.time()
        cfg = AppConfig.model_validate(config)
        torch.set_num_threads(cfg.torch_threads)
        registry = make_registry(cfg)
        model_dir = await asyncio.to_thread(replica_model_dir, cfg, registry)  # may download the base model
        marks["model_dir_ready"] = time.time()
        # engine.engine_process (on by default): the engine core runs in a child process, with this replica's torch
        # threads (forked from the node's warm start server when it runs); this process keeps the streams,
        # detokenizing and Serve
        launch = warm_start.core_launch() if cfg.warm_start else None
        engine = await asyncio.to_thread(AsyncLLMEngine, engine_config(cfg, model_dir), launch=launch)
        marks["engine_core_forked"] = _forked_elsewhere(engine.core_pid)
        marks["engine_ready"] = time.time()
        replica_id = serve.get_replica_context().replica_id.unique_id
        publish = residency_publisher() if cfg.push_residency else None
        sync = None
        if placement is not None:  # a handle to PlacementControllerDeployment
            sync = lambda rid, report: placement.sync.remote(rid, report)  # noqa: E731 - awaiting gives the result
        self._placement = placement
        self.server = LLMServer(cfg, engine, registry, replica_id, publish, placement_sync=sync)
        await self.server.start()
        if cfg.gc_freeze:  # this process serves one engine for its life: its start-up heap is permanent
            frozen = gc.get_freeze_count()  # a fork of the warm start server arrives with the imports frozen
            gc.collect()
            gc.freeze()
            marks["gc_frozen_objects"] = gc.get_freeze_count() - frozen
        marks["ready"] = time.time()
        marks["engine"] = dict(engine.startup)  # seconds: load_s, graph_capture_s, eager_warmup_s, total_s
        self.startup = marks
        if cfg.warm_start:  # for the replicas Ray starts on this node from now on (after this one is ready)
            asyncio.get_running_loop().run_in_executor(None, warm_start.ensure_server)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[dict]:
        async for chunk in self.server.generate(req):
            if "first_chunk_sent" not in self.startup:
                self.startup["first_chunk_sent"] = time.time()
            yield chunk

    # async: runs on the replica's event loop, like generate(), so it never reads the adapter
    # bookkeeping from a threadpool while a request mutates it.
    async def record_routing_stats(self) -> dict[str, Any]:
        return self.server.record_routing_stats()

    async def prompt_bound(self) -> PromptBound:
        """The longest prompt this replica could take, for the ingress to refuse longer ones unread."""
        return self.server.prompts.bound

    async def describe(self) -> dict[str, Any]:
        """Replica id, its engine core's process id (None: on a thread of the replica), known adapters, routing
        stats, placement share and start-up: wall-clock marks (process_started, constructor, imports_done,
        model_dir_ready, engine_ready, ready, first_chunk_sent), warm_start (the process was forked from the node's
        warm server) and the engine's own seconds."""
        return {"replica": self.server.replica_id, "engine_core_pid": self.server.engine.core_pid,
                "adapters": self.server.adapters.known(),
                "stats": self.server.record_routing_stats(), "placement": self.server.placement.share,
                "startup": self.startup}

    def check_health(self) -> None:
        if not self.server.engine.is_alive():
            raise RuntimeError("the engine core died (its process, its loop or a tensor-parallel rank)")

    async def __del__(self):
        await self.server.stop()
        if self._placement is not None:  # drained (Serve stops routing here first): out of the plan now
            try:
                await asyncio.wait_for(self._placement.leave.remote(self.server.replica_id), timeout=5)
            except Exception:  # noqa: BLE001 - the controller's heartbeat TTL takes it out anyway
                pass
        self.server.engine.shutdown()


def _forked_elsewhere(pid) -> bool:
    """Whether the engine core `pid` is not this process's child: a fork of the node's warm start server."""
    import psutil  # a Ray dependency

    return pid is not None and psutil.Process(pid).ppid() != os.getpid()


def _process_started_at() -> float:
    """When this worker process started (wall clock): a replacement's time from the kill to its constructor."""
    import psutil  # a Ray dependency

    return psutil.Process().create_time()
