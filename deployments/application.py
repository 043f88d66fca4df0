"""`serve run deployments.app`: the application builder.

    serve run deployments.app                         # embedded demo, 2 CPU replicas, port 8000
    serve run deployments.app num_replicas=3          # builder args override config
    LORASERVE_CONFIG=serve.yaml serve run deployments.app
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ray.serve.config import RequestRouterConfig

from deployments.bootstrap import bootstrap
from deployments.canary import CanaryControllerDeployment
from deployments.config import AppConfig, load_config
from deployments.data_plane import proxy_guard
from deployments.data_plane.ingress import OpenAIIngress
from deployments.replica.llm_deployment import LLMDeployment
from deployments.placement import PlacementControllerDeployment
from deployments.replica.resources import llm_replica_resources
from deployments.warm_start import launcher_command
from router.ray_router import ROUTER_CLASS_PATH

__all__ = ["build_app", "bind_app"]


def bind_app(cfg: AppConfig):
    """The bound application for an already bootstrapped config."""
    router = RequestRouterConfig(request_routing_stats_period_s=cfg.routing_stats_period_s)
    placement = None
    controller_options = {"num_cpus": 0, "resources": dict(cfg.controller_resources)}
    if cfg.placement_controller:
        placement = PlacementControllerDeployment.options(ray_actor_options=controller_options).bind(
            cfg.placement, cfg.max_loras, cfg.max_cpu_loras, cfg.placement_period_s, cfg.placement_replica_ttl_s)
    if cfg.affinity_router:
        router = RequestRouterConfig(request_router_class=ROUTER_CLASS_PATH, request_router_kwargs=dataclasses.asdict(cfg.router),
                                     request_routing_stats_period_s=cfg.routing_stats_period_s)
    threads = str(cfg.torch_threads)
    runtime_env: dict[str, Any] = {"env_vars": {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}}
    if cfg.warm_start:
        runtime_env["py_executable"] = launcher_command()
    resources = llm_replica_resources(cfg)  # with tensor parallelism, a placement group of one bundle per rank
    resources["ray_actor_options"] |= {"runtime_env": runtime_env}
    # fixed: num_replicas; autoscaled: Serve's autoscaling_config (then num_replicas must be left unset)
    scaling = ({"num_replicas": cfg.num_replicas} if cfg.autoscaling is None
               else {"autoscaling_config": cfg.autoscaling.model_dump(exclude_none=True)})
    llm = LLMDeployment.options(
        **scaling,
        max_ongoing_requests=cfg.max_ongoing_requests,
        request_router_config=router,
        health_check_period_s=cfg.health_check_period_s,
        health_check_timeout_s=cfg.health_check_timeout_s,
        **resources,
    ).bind(cfg.model_dump(mode="json"), placement)
    canary = None
    if cfg.canary.enabled and placement is not None:  # it reads the replicas' reports through the placement controller
        canary = CanaryControllerDeployment.options(ray_actor_options=controller_options).bind(
            cfg.model_dump(mode="json"), llm, placement)
    return OpenAIIngress.options(
        num_replicas=cfg.ingress_replicas,
        max_ongoing_requests=max(256, 4 * cfg.max_ongoing_requests * cfg.max_llm_replicas),
        ray_actor_options={"num_cpus": cfg.ingress_num_cpus},
    ).bind(llm, cfg.model_dump(mode="json"), placement, canary)


def build_app(args: dict[str, Any]):
    """Serve application builder: config from YAML/env/args, start-up registration, bind. `serve run` calls it
    before it starts a local Ray cluster, whose proxy then inherits the prompt guard's callback from this
    process's environment (`AppConfig.proxy_prompt_guard`)."""
    cfg = bootstrap(load_config(args))
    if cfg.proxy_prompt_guard:
        proxy_guard.install(os.environ)
    return bind_app(cfg)
