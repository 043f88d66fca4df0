"""The data plane in one process, all real parts but Ray: the FastAPI app of `create_openai_app`, a real
SQLite registry with the quick demo's adapters, and a real `LLMServer` over a real `AsyncLLMEngine`, called
the way the Serve ingress calls a replica. Clients: the official `openai` AsyncOpenAI over httpx's ASGI
transport. Everything runs on one event loop in a background thread (`kit.run(coro)`)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any, Optional

import httpx
import openai

from deployments.data_plane.protocol import GenerateRequest

KEYS = {"sk-kit-acme-00001": "acme", "sk-kit-globex-0001": "globex"}
ACME, GLOBEX = list(KEYS)


class InProcessLLM:
    """`LLMClient` over an `LLMServer` in this process (the Serve ingress does the same through a handle)."""

    def __init__(self, server):
        self.server = server

    async def stream(self, req: GenerateRequest):
        async for chunk in self.server.generate(req):
            yield chunk

    async def prompt_bound(self):
        return self.server.prompts.bound


@dataclass
class Kit:
    app: Any
    deps: Any
    server: Any
    engine: Any
    registry: Any
    cfg: Any
    demo: dict
    loop: asyncio.AbstractEventLoop

    def run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def client(self, key: str = ACME, app: Any = None) -> openai.AsyncOpenAI:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app or self.app), base_url="http://kit")
        return openai.AsyncOpenAI(base_url="http://kit/v1", api_key=key, max_retries=0, http_client=http, timeout=60)

    def http(self, app: Any = None) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=app or self.app), base_url="http://kit", timeout=60)

    @property
    def base(self) -> str:
        return self.cfg.base_model_name

    @property
    def adapter(self) -> str:
        return sorted(self.demo)[0]


def build(tmp, engine: Optional[dict] = None, **deps_overrides) -> Kit:
    """engine: the app config's engine section (EngineConfig fields) over the defaults."""
    import shutil

    from deployments.bootstrap import bootstrap, demo_paths, make_registry, sha256_of_dir
    from deployments.config import load_config
    from deployments.engine_settings import engine_config
    from deployments.replica.llm_server import LLMServer
    from deployments.data_plane.openai_api import IngressDeps, create_openai_app
    from deployments.data_plane.rate_limit import ColdLoadGate, RateLimiter, RefusalHold
    from engine_ext import AsyncLLMEngine
    from registry import AdapterDisabled, AdapterNotFound

    registry = {"registry_db": str(tmp / "r.db"), "blob_dir": str(tmp / "blobs"), "materialize_dir": str(tmp / "mat"),
                "allowed_local_roots": [str(tmp / "in")], "poll_interval_s": 0.2}
    cfg = bootstrap(load_config({"demo_recipe": "quick", "registry": registry, "api_keys": KEYS,
                                 "engine": engine or {}}, env={}))
    paths = demo_paths(cfg)
    reg = make_registry(cfg)
    src = tmp / "in" / "secret"
    shutil.copytree(paths["adapters"][sorted(paths["adapters"])[0]], src)
    reg.register("globex-secret", str(src), sha256_of_dir(src), cfg.base_model_name, actor="test", tenant="globex",
                 visibility="tenant", activate=True)
    engine = AsyncLLMEngine(engine_config(cfg, paths["model"]))
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="kit-loop", daemon=True).start()
    server = LLMServer(cfg, engine, reg, "kit-replica")
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(60)
    # its tests send hundreds of refused requests in a row on purpose: no bench unless a test asks for one
    deps_overrides.setdefault("hold", RefusalHold(hold_s=0))
    deps = IngressDeps(base_name=cfg.base_model_name, api_keys=KEYS, resolver=reg, llm=InProcessLLM(server),
                       limiter=RateLimiter((1000, 1000), (1000, 1000)), gate=ColdLoadGate(limit=8, wait_s=30),
                       registry_errors=(AdapterNotFound, AdapterDisabled), **deps_overrides)
    return Kit(create_openai_app(deps), deps, server, engine, reg, cfg, paths["adapters"], loop)


def close(kit: Optional[Kit]) -> None:
    if kit is None:
        return
    kit.run(kit.server.stop())
    kit.loop.call_soon_threadsafe(kit.loop.stop)
    kit.engine.shutdown()
    kit.registry.close()
