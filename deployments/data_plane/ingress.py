"""The Serve deployment `OpenAIIngress`: the FastAPI data plane plus the control plane under
`admin_prefix`, talking to `LLMServer` through a deployment handle."""

from __future__ import annotations

import asyncio
import hmac
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import Request
from fastapi.responses import JSONResponse

from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.config import AppConfig
from deployments.dependency_health import DependencyGauge, DependencyHealth, DependencyUnavailable
from deployments.metrics import PlacementTiers, ServingMetrics
from deployments.placement import PlacementReporter
from deployments.data_plane.errors import APIError, error_response
from deployments.data_plane import proxy_guard
from deployments.data_plane.openai_api import IngressDeps, create_openai_app
from deployments.data_plane.protocol import GenerateRequest, PromptBound, ReplicaUnavailable
from deployments.data_plane.rate_limit import ColdLoadGate, RateLimiter, RedisRateLimiter, RefusalHold
from deployments.registry_view import RegistryView
from router.keys import AdapterKey

__all__ = ["OpenAIIngress", "ServeLLMClient"]


class ServeLLMClient:
    """`LLMClient` over a handle: the adapter key travels as the multiplexed model id, which
    is what `router.AffinityRouter` (and Ray's default router) route on."""

    def __init__(self, handle: DeploymentHandle, reporter: Optional[PlacementReporter] = None):
        from ray.exceptions import RayActorError
        from ray.serve.exceptions import ReplicaUnavailableError

        self._handle, self._reporter = handle, reporter
        # The replica died or cannot be reached: the request is not at fault and may go to another one.
        self._replica_failures = (RayActorError, ReplicaUnavailableError)

    async def stream(self, req: GenerateRequest) -> AsyncIterator[dict]:
        if self._reporter is not None and req.adapter_key:
            self._reporter.count(AdapterKey.family(req.adapter_key))
        gen = self._handle.options(stream=True, multiplexed_model_id=req.adapter_key or "").generate.remote(req)
        try:
            async for chunk in gen:
                yield chunk
        except self._replica_failures as e:
            raise ReplicaUnavailable(f"{type(e).__name__}") from e
        finally:
            gen.cancel()  # no-op when finished; aborts the replica's generation otherwise


    async def prompt_bound(self) -> PromptBound:
        return await self._handle.prompt_bound.remote()


@serve.deployment(name="OpenAIIngress")
@serve.ingress()
class OpenAIIngress:
    async def __init__(self, llm: DeploymentHandle, config: dict[str, Any],
                       placement: Optional[DeploymentHandle] = None, canary: Optional[DeploymentHandle] = None):
        from registry import AdapterDisabled, AdapterNotFound
        from registry.api import create_app as create_admin_app

        from deployments.bootstrap import make_registry

        cfg = AppConfig.model_validate(config)
        self.cfg = cfg
        self.registry = make_registry(cfg)
        self.health = DependencyHealth()
        metrics = ServingMetrics()
        metrics.registry.register(DependencyGauge(self.health))
        self.view = RegistryView(self.registry, self.health, metrics.cached_answers)
        self.placement = None if placement is None else PlacementReporter(placement, cfg.placement_period_s,
                                                                          on_reports=self._export_reports)
        from deployments.canary import GoldenClient, RolloutReporter

        llm_client = ServeLLMClient(llm, self.placement)
        self._replica_reports: Optional[dict[str, dict[str, Any]]] = None  # the latest, for a rollout's live window
        golden = GoldenClient(llm_client, cfg.canary.golden_timeout_s).checker(asyncio.get_running_loop())
        admin = create_admin_app(self.registry, tokens={cfg.admin_token: {"role": "admin", "name": "admin"}},
                                 golden=golden, replica_reports=lambda: self._replica_reports)
        self.rollouts = None if canary is None else RolloutReporter(canary, cfg.placement_period_s, self._public)
        if self.rollouts is not None:
            metrics.registry.register(self.rollouts)
            self.rollouts.start()
        rates = lambda specs: {k: (v.rate, v.burst) for k, v in specs.items()}  # noqa: E731
        limiter = RateLimiter((cfg.tenant_rate.rate, cfg.tenant_rate.burst),
                              (cfg.adapter_rate.rate, cfg.adapter_rate.burst),
                              rates(cfg.tenant_rates), rates(cfg.adapter_rates))
        redis_url = cfg.rate_limit_redis_url or self.registry.settings.redis_url
        self.deps = IngressDeps(
            base_name=cfg.base_model_name or "base",
            api_keys=dict(cfg.api_keys),
            resolver=self.view,
            llm=llm_client,
            limiter=RedisRateLimiter(redis_url, limiter, self.health) if redis_url else limiter,
            gate=ColdLoadGate(limit=cfg.cold_load_concurrency, wait_s=cfg.cold_load_wait_s),
            hold=RefusalHold(**cfg.refusal_hold.model_dump()),
            metrics=metrics,
            readiness=self.view.probe,
            max_tokens_limit=cfg.max_tokens_limit,
            max_request_bytes=cfg.max_request_bytes,
            metrics_token=cfg.metrics_token,
            retries=cfg.replica_retries,
            admin_app=admin,
            admin_prefix=cfg.admin_prefix,
            registry_errors=(AdapterNotFound, AdapterDisabled),
            upload_prefix=f"{cfg.admin_prefix}/v1/uploads/",
            publish_guard_limits=proxy_guard.publish,
        )
        self.deps.prompt_bound.get(self.deps.llm)  # asked now: known before the first long prompt comes
        if self.placement is not None:
            self.placement.start()  # on the replica's event loop: replica reports flow before any request

    def _public(self) -> Callable[[str], bool]:
        """Whether an adapter key or name may appear in /metrics: any with the metrics token; without it the
        public ones only (the registry's public listing; none while it is out of reach with nothing cached)."""
        if self.cfg.metrics_token is not None:
            return lambda key: True
        try:
            public = self.view.public_names()
        except DependencyUnavailable:
            public = set()
        return lambda key: AdapterKey.family(key) in public

    def _export_reports(self, reports: dict[str, dict[str, Any]]) -> None:
        """The replicas' timer reports into /metrics, tenant-private adapters left out of an open one, like the
        series that ride on responses."""
        self._replica_reports = reports
        self.deps.metrics.replicas.replace_all(reports, self._public())

    def __serve_build_asgi_app__(self):
        app = create_openai_app(self.deps)
        if self.placement is not None:
            self.deps.metrics.registry.register(PlacementTiers(self.placement.tiers, self._public))
            add_placement_route(app, self.placement, self.cfg.admin_token, self.cfg.admin_prefix)
        return app


def add_placement_route(app, reporter: PlacementReporter, admin_token: str, prefix: str) -> None:
    """`GET {prefix}/v1/placement` (admin token): the controller's current plan, fresh. Inserted
    ahead of the control plane's mount at `prefix`, which would otherwise take the path."""
    async def placement(request: Request) -> JSONResponse:
        auth = request.headers.get("authorization", "")
        if not hmac.compare_digest(auth.encode(), f"Bearer {admin_token}".encode()):
            return error_response(APIError(401, "the admin token is needed: send 'Authorization: Bearer TOKEN'",
                                           code="unauthorized", headers={"WWW-Authenticate": "Bearer"}))
        return JSONResponse(await reporter.refresh())

    app.add_api_route(f"{prefix}/v1/placement", placement, methods=["GET"], include_in_schema=False)
    app.router.routes.insert(0, app.router.routes.pop())
