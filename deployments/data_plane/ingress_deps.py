"""What the OpenAI data plane is built from: its neighbours as protocols (the registry as a `Resolver`, the
replicas as an `LLMClient`, a `Limiter`) and its settings, one `IngressDeps` the Serve ingress fills (and tests
fill with fakes)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Mapping, Optional, Protocol

from deployments.data_plane.protocol import GenerateRequest, PromptBound
from deployments.data_plane.rate_limit import ColdLoadGate, RefusalHold
from deployments.metrics import ServingMetrics

__all__ = ["IngressDeps", "KnownBound", "LLMClient", "Resolver", "Limiter"]

logger = logging.getLogger(__name__)


class Resolver(Protocol):
    def resolve(self, name: str, tenant: Optional[str], request_id: Optional[str] = None) -> Any: ...
    def list_adapters(self, tenant: Optional[str] = None) -> list: ...


class LLMClient(Protocol):
    def stream(self, req: GenerateRequest) -> AsyncIterator[dict]: ...

    async def prompt_bound(self) -> PromptBound: ...  # the replicas' (each replica has the same)


class Limiter(Protocol):
    blocking: bool  # take() waits on I/O (it is called from a worker thread then)

    def take(self, scope: str, key: str) -> None: ...  # scope "tenant" or "adapter"; raises RateLimited


@dataclass
class IngressDeps:
    base_name: str
    api_keys: Mapping[str, str]  # key -> tenant
    resolver: Resolver
    llm: LLMClient
    limiter: Limiter
    gate: ColdLoadGate
    # a caller refused over and over is benched, its answers held (its flood slowed), at most so many at a time
    hold: RefusalHold = field(default_factory=RefusalHold)
    metrics: ServingMetrics = field(default_factory=ServingMetrics)
    max_tokens_limit: int = 4096
    default_completion_tokens: int = 16  # OpenAI's default for /v1/completions
    default_chat_tokens: int = 256
    max_request_bytes: int = 2 * 2**20  # larger bodies get a 413 before they are read
    metrics_token: Optional[str] = None  # None: /metrics is open and shows no tenant-private adapter names
    retries: int = 3  # a request whose replica fails before the client saw a token is retried this often
    retry_backoff_s: float = 0.2
    admin_app: Any = None
    admin_prefix: str = "/admin"
    registry_errors: tuple = ()  # (not_found_cls, disabled_cls): registry exception classes
    # -> dependency -> up (the registry's stores): `/ready` answers 503 while one is down; None: always ready
    readiness: Optional[Callable[[], Mapping[str, bool]]] = None
    upload_prefix: Optional[str] = None  # uploads under this path have the control plane's own size limit
    clock: Callable[[], float] = time.time
    # the replicas' prompt bound, asked of one in the background; until it answers prompts are checked on the replica
    prompt_bound: "KnownBound" = field(default_factory=lambda: KnownBound())
    # (route prefix, GuardLimits) -> None: the limits for Serve's proxies (proxy_guard.publish); None: not published
    publish_guard_limits: Optional[Callable[[str, Any], None]] = None


@dataclass
class KnownBound:
    """The replicas' `PromptBound`, asked of one replica once, in the background: None until one answers."""

    value: Optional[PromptBound] = None
    retry_s: float = 1.0  # the first wait after a failed ask; doubled up to 30 s
    _task: Optional[asyncio.Task] = None

    def get(self, llm: LLMClient) -> Optional[PromptBound]:
        """The bound if known; the first call starts asking `llm` for it (on the running loop)."""
        if self.value is None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._ask(llm))
        return self.value

    async def _ask(self, llm: LLMClient) -> None:
        wait = self.retry_s
        while self.value is None:
            try:
                self.value = await llm.prompt_bound()
            except Exception as e:  # noqa: BLE001 - no replica yet, or one that failed: ask again later
                logger.info("asking a replica for its prompt bound failed (%s); again in %.0fs", e, wait)
                await asyncio.sleep(wait)
                wait = min(30.0, 2 * wait)
