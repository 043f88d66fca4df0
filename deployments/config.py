"""The application's configuration: one pydantic model, from YAML, env and builder args.

Precedence, lowest first: defaults < YAML file named by `LORASERVE_CONFIG` < `LORASERVE_*`
environment variables < `serve run deployments.app key=value` / serveConfigV2 `args`.
Registry settings (Redis, S3, blob dir) live in `registry` and are handed to
`RegistrySettings`; left empty, the registry reads its own env (REDIS_URL, S3_BUCKET, ...).

The engine's settings are the `engine` section, `EngineConfig` fields checked by `EngineConfig` itself
over the device's profile (deployments.engine_settings). Each source may set it whole (`engine: {...}`,
`LORASERVE_ENGINE='{...}'`, `engine='{...}'`) or field by field (`LORASERVE_ENGINE_<FIELD>`,
`engine.<field>=value`); sections merge field by field in the order above. The top-level names in
`engine_settings.FLAT_ALIASES` (`device`, `dtype`, `max_loras`, ...) are aliases of their engine fields.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Literal, Mapping, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from router.placement import PlacementConfig
from router.policy import AffinityConfig

__all__ = ["AppConfig", "AutoscalingSpec", "CanaryConfig", "ConfigError", "RateSpec", "RefusalHoldSpec", "load_config",
           "DEFAULT_API_KEY", "DEFAULT_ADMIN_TOKEN", "ENV_PREFIX"]

logger = logging.getLogger(__name__)

ENV_PREFIX = "LORASERVE_"
DEFAULT_API_KEY = "sk-loraserve-dev"  # maps to tenant "default"; documented in the README
DEFAULT_ADMIN_TOKEN = "loraserve-admin-dev"


class ConfigError(ValueError):
    """The app's configuration is refused; the message names each field at fault."""


class RateSpec(BaseModel):
    """A token bucket: `rate` requests per second on average, bursts up to `burst`."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    rate: float = Field(gt=0, description="requests per second refilled")
    burst: float = Field(ge=1, description="bucket size: requests allowed back to back")


class RefusalHoldSpec(BaseModel):
    """Benching a caller whose requests keep being refused (deployments.data_plane.rate_limit.RefusalHold)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    hold_s: float = Field(1.0, ge=0, le=30, description="how long a benched caller's 429s are held, and its bench "
                          "lasts after its last request; 0: never benched")
    after: int = Field(20, ge=0, description="4xx answers to one caller within a second before it is benched")
    max_held: int = Field(64, ge=0, description="answers held at a time per ingress replica; more are answered at once")


class CanaryConfig(BaseModel):
    """The rollout controller (deployments.canary): automatic canary analysis, promotion and rollback."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    enabled: bool = Field(True, description="run the rollout controller (it reads the replicas' reports through the "
                          "placement controller, so it runs only with placement_controller)")
    period_s: float = Field(1.0, gt=0, description="how often each running rollout's window is looked at")
    golden_timeout_s: float = Field(60.0, gt=0, description="longest wait for one golden prompt's answer")


class AutoscalingSpec(BaseModel):
    """Serve's autoscaling of the LLM deployment (its `autoscaling_config`): replicas are added while the
    requests in flight per replica stay above `target_ongoing_requests` for `upscale_delay_s`, and removed
    while they stay below it for `downscale_delay_s`. The placement controller takes a new replica in at its
    first heartbeat and a removed one out when it drains (its homes move to the others)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    min_replicas: int = Field(1, ge=0)
    initial_replicas: Optional[int] = Field(None, ge=0, description="None: min_replicas")
    max_replicas: int = Field(4, ge=1)
    target_ongoing_requests: float = Field(8.0, gt=0, description="requests in flight per replica Serve aims at")
    upscale_delay_s: float = Field(30.0, ge=0)
    downscale_delay_s: float = Field(600.0, ge=0)
    metrics_interval_s: float = Field(10.0, gt=0, description="how often replicas report their load")
    look_back_period_s: float = Field(30.0, gt=0, description="the window the load is averaged over")

    @model_validator(mode="after")
    def _bounds(self) -> "AutoscalingSpec":
        start = self.min_replicas if self.initial_replicas is None else self.initial_replicas
        if not self.min_replicas <= start <= self.max_replicas:
            raise ValueError("need min_replicas <= initial_replicas <= max_replicas")
        return self


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # --- model and engine -----------------------------------------------------------
    model: Optional[str] = Field(None, description=(
        "the base model: an HF model dir, or registry://NAME for one stored in the registry (`lora-registry "
        "base-model NAME DIR --upload`; each replica fetches it); None: the embedded demo"))
    base_model_name: Optional[str] = Field(
        None, description="the base model's name in the registry and in `model`; default: the dir's name"
    )
    register_demo_adapters: bool = Field(True, description="register the demo adapters (demo model only)")
    demo_recipe: Literal["smollm2", "toy", "quick"] = Field("smollm2", description=(
        "the embedded demo: SmolLM2-135M-Instruct (a PyPI wheel) and its adapters, or the toy model trained here "
        "(no download; quick: its seconds-long build, for tests)"))
    engine: dict[str, Any] = Field(
        default_factory=dict, description="engine_ext.EngineConfig fields (all but `model`): what is not set takes "
        "the device profile's default (deployments.engine_settings); after loading, every field resolved")
    torch_threads: int = Field(1, ge=1, description="torch threads per replica (CPU)")

    # --- replicas -------------------------------------------------------------------
    num_replicas: int = Field(2, ge=1, description="LLM replicas (without `autoscaling`)")
    autoscaling: Optional[AutoscalingSpec] = Field(None, description=(
        "autoscale the LLM deployment between min_replicas and max_replicas; None: num_replicas, fixed"))
    replica_resources: dict[str, float] = Field(default_factory=dict, description=(
        "custom Ray resources each LLM replica needs besides CPUs and GPUs (ray_actor_options.resources): e.g. "
        "{\"llm_slot\": 1} with each node started with --resources '{\"llm_slot\": N}' holds N replicas a node"))
    num_cpus_per_replica: float = Field(0.5, ge=0)
    num_gpus_per_replica: float = Field(0.0, ge=0)
    max_ongoing_requests: int = Field(32, ge=1, description="per LLM replica")
    ingress_replicas: int = Field(1, ge=1)
    ingress_num_cpus: float = Field(0.25, ge=0)
    affinity_router: bool = Field(True, description="False: Ray Serve's default router (for comparison)")
    router: AffinityConfig = Field(default_factory=AffinityConfig, description=(
        "router.policy.AffinityConfig fields, checked by AffinityConfig itself"))
    placement_controller: bool = Field(True, description="run the placement controller (tiers, homes, prefetch)")
    placement: PlacementConfig = Field(default_factory=PlacementConfig, description=(
        "router.placement.PlacementConfig fields, checked by PlacementConfig itself"))
    placement_period_s: float = Field(1.0, gt=0, description="re-plan, report and replica sync period")
    canary: CanaryConfig = Field(default_factory=CanaryConfig, description="automatic rollouts (CanaryConfig fields)")
    controller_resources: dict[str, float] = Field(
        default_factory=lambda: {"node:__internal_head__": 0.001}, description=(
            "Ray resources the placement and rollout controllers need (they take no CPU): by default a sliver of "
            "the head node's own resource, so they run beside Serve's controller and losing a worker node (a "
            "reclaimed GPU machine) never takes them with it; {}: anywhere"))
    placement_replica_ttl_s: float = Field(10.0, gt=0, description=(
        "a replica whose heartbeat is this late leaves the plan (its node lost, say): its pinned adapters get "
        "a new second home on a live replica"))
    push_residency: bool = Field(
        True, description="replicas push their adapter ids to Serve's controller on every load (both routers see it)"
    )
    routing_stats_period_s: float = Field(1.0, gt=0)
    # How often Serve checks each LLM replica, and how long a check may take. Serve notices a replica that died
    # at its next check (it ignores the failures of its other calls to it): half a period after the death on
    # average, at 2 s a third of a warm replacement's time. Checks every 0.5 s cost each LLM replica about 0.6%
    # of a core and the controller about 0.3% per replica more than every 2 s (bench/RESULTS.md section 8).
    health_check_period_s: float = Field(0.5, gt=0)
    health_check_timeout_s: float = Field(10.0, gt=0)
    warm_start: bool = Field(True, description=(
        "start LLM replicas' worker processes as forks of a per-node server that already imported Ray, torch, "
        "transformers and this project (deployments.warm_start): a replacement serves in seconds, not after a "
        "new process's imports; False: Ray starts each one cold"))
    gc_freeze: bool = Field(True, description=(
        "once an LLM replica is ready, collect garbage once and freeze what is alive (gc.freeze): the interpreter's "
        "full collections then skip the start-up heap (imports, engine, server), which otherwise stalls the "
        "engine thread for a quarter second at a time on a CPU VM (bench/host_time.py --gc); False: Python's "
        "default collector"))

    # --- tenants, limits, control plane ----------------------------------------------
    api_keys: dict[str, str] = Field(
        default_factory=lambda: {DEFAULT_API_KEY: "default"}, description="API key -> tenant"
    )
    admin_token: str = Field(DEFAULT_ADMIN_TOKEN, min_length=8)
    admin_prefix: str = "/admin"
    tenant_rate: RateSpec = RateSpec(rate=50, burst=100)
    tenant_rates: dict[str, RateSpec] = Field(default_factory=dict, description="per-tenant overrides")
    adapter_rate: RateSpec = RateSpec(rate=100, burst=200)
    adapter_rates: dict[str, RateSpec] = Field(default_factory=dict, description="per-adapter overrides")
    refusal_hold: RefusalHoldSpec = RefusalHoldSpec()
    cold_load_concurrency: int = Field(2, ge=1, description="in-flight requests for an adapter not yet loaded")
    cold_load_wait_s: float = Field(30.0, gt=0, description="wait for a cold-load slot before answering 429")
    max_tokens_limit: int = Field(4096, ge=1, description="largest max_tokens a request may ask for")
    max_request_bytes: int = Field(2 * 2**20, ge=1024, description="larger request bodies get a 413 unread")
    proxy_prompt_guard: bool = Field(
        True, description="name the prompt guard (deployments.data_plane.proxy_guard) as Serve's proxy callback "
        "for the Ray cluster `serve run` starts, so prompts too long for the context are refused in the proxy; "
        "a cluster already running needs RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH in its environment instead")
    metrics_token: Optional[str] = Field(
        None, min_length=8, description="bearer token /metrics needs; None: /metrics is open and labels "
        "tenant-private adapters 'private'")
    rate_limit_redis_url: Optional[str] = Field(
        None, description="Redis for rate-limit buckets shared by every ingress replica; None: the registry's "
        "redis_url when it has one, else per-replica buckets")
    replica_retries: int = Field(3, ge=0, description="retries of a request whose replica fails before its first token")

    registry: dict[str, Any] = Field(default_factory=dict, description="RegistrySettings fields")

    @field_validator("admin_prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if not v.startswith("/") or v.rstrip("/") in ("", "/v1") or v.startswith("/v1/"):
            raise ValueError("admin_prefix must start with '/' and not overlap '/v1'")
        return v.rstrip("/")

    @field_validator("api_keys")
    @classmethod
    def _keys(cls, v: dict[str, str]) -> dict[str, str]:
        if not v:
            raise ValueError("api_keys must map at least one key to a tenant")
        for key, tenant in v.items():
            if len(key) < 8 or not tenant:
                raise ValueError("API keys need >= 8 characters and a non-empty tenant")
        return v

    @model_validator(mode="before")
    @classmethod
    def _gather_engine(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        rest, engine = split_engine(data)
        return {**rest, "engine": engine}

    @model_validator(mode="after")
    def _derive(self) -> "AppConfig":
        from deployments.engine_settings import resolve_engine

        self.engine = resolve_engine(self.engine, self.num_gpus_per_replica)
        if self.num_gpus_per_replica > 0 and not self.engine["device"].startswith("cuda"):
            raise ValueError("num_gpus_per_replica > 0 needs engine.device 'cuda'")
        return self

    def uses_default_admin_token(self) -> bool:
        return self.admin_token == DEFAULT_ADMIN_TOKEN

    @property
    def max_llm_replicas(self) -> int:
        """The most LLM replicas that may run at once."""
        return self.num_replicas if self.autoscaling is None else self.autoscaling.max_replicas

    @property
    def max_loras(self) -> int:
        return self.engine["max_loras"]

    @property
    def max_cpu_loras(self) -> int:
        return self.engine["max_cpu_loras"]


def _json_or_str(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def split_engine(source: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """One source's (other fields, engine fields): its `engine` section (a mapping or its JSON), then its
    `engine.<field>` keys and top-level aliases. A field set twice in one source with two values is an error."""
    from deployments.engine_settings import FLAT_ALIASES

    rest = dict(source)
    section = rest.pop("engine", None) or {}
    if isinstance(section, str):
        section = _json_or_str(section)
    if not isinstance(section, Mapping):
        raise ValueError(f"engine must be a mapping of EngineConfig fields (or its JSON), got {section!r}")
    engine = dict(section)
    for key in [k for k in rest if k.startswith("engine.") or k in FLAT_ALIASES]:
        name, value = key.removeprefix("engine."), rest.pop(key)
        if name in engine and engine[name] != value:
            raise ValueError(f"engine.{name} is set twice: {engine[name]!r} and {value!r} (as {key!r})")
        engine[name] = value
    return rest, engine


def _env_overrides(env: Mapping[str, str]) -> list[dict[str, Any]]:
    """[`LORASERVE_<FIELD>` of every field and alias, `LORASERVE_ENGINE_<FIELD>` of every engine field] (the
    second overrides `LORASERVE_ENGINE`); values are JSON when they parse, else strings."""
    from deployments.engine_settings import FLAT_ALIASES, engine_fields

    fields, engine = {}, {}
    for name in (*AppConfig.model_fields, *FLAT_ALIASES):
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is not None:
            fields[name] = _json_or_str(raw)
    for name in engine_fields():
        raw = env.get(f"{ENV_PREFIX}ENGINE_{name.upper()}")
        if raw is not None:
            engine[f"engine.{name}"] = _json_or_str(raw)
    return [fields, engine]


def load_config(args: Optional[Mapping[str, Any]] = None, env: Optional[Mapping[str, str]] = None) -> AppConfig:
    """Merge YAML (`LORASERVE_CONFIG`), env and `args`; validate once at the end."""
    env = os.environ if env is None else env
    sources: list[Mapping[str, Any]] = []
    path = env.get(ENV_PREFIX + "CONFIG")
    if path:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: expected a YAML mapping of AppConfig fields")
        sources.append(loaded)
    sources += [*_env_overrides(env), dict(args or {})]
    merged: dict[str, Any] = {}
    engine: dict[str, Any] = {}
    for source in sources:
        rest, section = split_engine(source)
        merged.update(rest)
        engine.update(section)
    try:
        cfg = AppConfig.model_validate({**merged, "engine": engine})
    except ValidationError as e:  # one line per problem, not pydantic's report of every union member tried
        problems = [(".".join(map(str, err["loc"])), str(err["msg"]).removeprefix("Value error, "))
                    for err in e.errors()]
        raise ConfigError("invalid configuration: " + "; ".join(f"{loc}: {msg}" if loc else msg
                                                                for loc, msg in problems)) from None
    if cfg.uses_default_admin_token():
        logger.warning(
            "control plane uses the default admin token %r: set LORASERVE_ADMIN_TOKEN outside development",
            DEFAULT_ADMIN_TOKEN,
        )
    return cfg
