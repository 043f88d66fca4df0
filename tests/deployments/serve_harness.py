"""One real Serve app (local Ray cluster, demo model, 2 CPU LLM replicas, SQLite registry in a
temp dir) shared by every end-to-end test module of the session, whichever folder it is in.

Import it as `tests.deployments.serve_harness` only (one module object, one app). Each
folder's conftest wraps `acquire()` / `release()` in a session fixture; the last release
shuts Serve and Ray down.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

# The development defaults are there too (DEFAULT_API_KEY -> "default", DEFAULT_ADMIN_TOKEN), so a page that
# uses them (docs/operator.md) runs against this app as printed.
KEYS = {"sk-test-acme-0001": "acme", "sk-test-globex-01": "globex", "sk-test-limited-1": "limited",
        "sk-loraserve-dev": "default", "sk-test-loadgen-1": "loadgen"}
LOAD_KEY = "sk-test-loadgen-1"  # a tenant without a practical rate limit, for measurement load
ADMIN = "loraserve-admin-dev"
UPLOAD_LIMIT = 64 * 2**20  # the registry's max_file_bytes here: the upload limit
AFFINITY_ADAPTERS = [f"aff-{i:02d}" for i in range(20)]
APP_NAME = "loraserve"


@dataclass
class ServeApp:
    base_url: str  # http://127.0.0.1:port
    base_name: str
    demo_adapters: dict[str, str]
    root: Path
    registry: Any  # a Registry on the same SQLite file (tests register fixtures with it)
    extra: dict = field(default_factory=dict)

    def replica_stats(self) -> dict[str, dict]:
        """replica id -> its `record_routing_stats()`, asked of every LLM replica actor directly."""
        import ray

        out = {}
        for info in ray.util.list_named_actors(all_namespaces=True):
            name = info["name"] if isinstance(info, dict) else info
            if name.startswith(f"SERVE_REPLICA::{APP_NAME}#LLMServer#"):
                actor = ray.get_actor(name, namespace="serve")
                out[name.rsplit("#", 1)[-1]] = ray.get(actor.record_routing_stats.remote(), timeout=10)
        return out


_state: dict[str, Any] = {"app": None, "refs": 0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _register_fixtures(reg, incoming: Path, base: str, demo: dict[str, str]) -> None:
    """Private adapters, a two-version adapter and 20 copies for the affinity test."""
    from deployments.bootstrap import sha256_of_dir

    names = sorted(demo)

    def stage(src: str, label: str) -> str:
        dst = incoming / label
        shutil.copytree(src, dst)
        return str(dst)

    def add(name, src, **kw):
        d = stage(src, f"{name}-{time.monotonic_ns()}")
        return reg.register(name, d, sha256_of_dir(Path(d)), base, actor="test", **kw)

    add("globex-private", demo[names[0]], tenant="globex", visibility="tenant", activate=True)
    add("promo", demo[names[0]], activate=True)  # v1
    add("promo", demo[names[1 % len(names)]])  # v2: ready, not serving
    add("switch", demo[names[0]], activate=True)
    for i, name in enumerate(AFFINITY_ADAPTERS):
        add(name, demo[names[i % len(names)]], activate=True)


def acquire() -> ServeApp:
    if _state["app"] is None:
        _state["app"] = _start()
    _state["refs"] += 1
    return _state["app"]


def release() -> None:
    _state["refs"] -= 1
    if _state["refs"] <= 0 and _state["app"] is not None:
        _stop(_state.pop("app"))
        _state["app"] = None


def _start() -> ServeApp:
    import ray
    from ray import serve

    from deployments.application import bind_app
    from deployments.bootstrap import bootstrap, make_registry
    from deployments.config import load_config
    from deployments.bootstrap import demo_paths

    root = Path(tempfile.mkdtemp(prefix="loraserve-e2e-"))
    incoming = root / "incoming"
    incoming.mkdir()
    registry_settings = {
        "registry_db": str(root / "registry.db"),
        "blob_dir": str(root / "blobs"),
        "materialize_dir": str(root / "materialized"),
        "allowed_local_roots": [str(incoming)],
        "upload_dir": str(root / "uploads"),
        "poll_interval_s": 0.2,
        "max_file_bytes": UPLOAD_LIMIT,
        "max_lora_rank": 8192,  # registration only (the engine's is 64): a 50 MB adapter of the demo's shapes
    }
    args = {
        "demo_recipe": "quick",  # the demo's code path at test size
        "num_replicas": 2,
        "num_cpus_per_replica": 0.5,
        "ingress_num_cpus": 0.25,
        "max_ongoing_requests": 16,
        "routing_stats_period_s": 0.5,
        "api_keys": KEYS,
        "admin_token": ADMIN,
        "tenant_rates": {"limited": {"rate": 0.01, "burst": 2}, "loadgen": {"rate": 1e6, "burst": 1e6}},
        "cold_load_wait_s": 60,
        "registry": registry_settings,
    }
    cfg = bootstrap(load_config(args, env={}))
    demo = demo_paths(cfg)["adapters"]
    reg = make_registry(cfg)
    _register_fixtures(reg, incoming, cfg.base_model_name, demo)

    cluster_env()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(bind_app(cfg), name=APP_NAME, route_prefix="/")
    return ServeApp(f"http://127.0.0.1:{port}", cfg.base_model_name, demo, root, reg)


def cluster_env() -> None:
    """What a Ray cluster this process starts inherits: credentials for moto's S3 (it takes any), and
    the prompt guard named as Serve's proxy callback, as `serve run deployments.app` names it."""
    import os

    from deployments.data_plane import proxy_guard

    for key, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                       ("AWS_DEFAULT_REGION", "us-east-1")):
        os.environ.setdefault(key, value)
    proxy_guard.install(os.environ)


def refused_in_proxy(base_url: str, key: str, model: str, chars: int, timeout_s: float = 30) -> float:
    """Sends a chat prompt of `chars` characters too many for the context (each answered 400
    `context_length_exceeded`, the message naming the bound) until the app's /metrics counts one more prompt refused
    in Serve's proxy (`proxy_guard`: a proxy reads the ingress's published limits every second until it has them)
    -> how many more it counts than before the first (0: none within `timeout_s`). A scrape reads one ingress
    replica's counters: with several, a fresh app's (all at 0 before) or one replica's count."""
    import httpx

    def count() -> float:
        text = httpx.get(f"{base_url}/metrics", timeout=30).text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("loraserve_prompts_refused_in_proxy_total"))

    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "x" * chars}]}).encode()
    before, deadline = count(), time.monotonic() + timeout_s
    while True:
        r = httpx.post(f"{base_url}/v1/chat/completions", content=body, timeout=60,
                       headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "messages", r.text
        assert "characters a token" in err["message"]
        now = count()
        if now > before or time.monotonic() > deadline:
            return now - before
        time.sleep(1)


def _stop(app: Optional[ServeApp]) -> None:
    """Ends the cluster this process started, Serve's actors with it: no test reads the apps after the last one,
    so the graceful `serve.shutdown()` (each replica waits out its 2 s drain loop) would only add seconds."""
    import ray

    try:
        ray.shutdown()
    finally:
        if app is not None:
            app.registry.close()
            shutil.rmtree(app.root, ignore_errors=True)


@contextlib.contextmanager
def deployed(cfg, app: str, route_prefix: str):
    """A test module's own app from `cfg`, deployed as `app` under `route_prefix` on the session's Ray cluster
    when one runs, else on a cluster of its own (shut down after) -> the app's base URL."""
    import ray
    from ray import serve

    from deployments.application import bind_app

    owns = not ray.is_initialized()
    if owns:
        cluster_env()
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        base = f"http://127.0.0.1:{port}"
    else:
        base = _state["app"].base_url
    serve.run(bind_app(cfg), name=app, route_prefix=route_prefix)
    try:
        yield f"{base}{route_prefix}"
    finally:
        serve.delete(app)
        if owns:
            serve.shutdown()
            ray.shutdown()


def llm_replicas(app: str) -> dict[str, Any]:
    """replica id -> actor handle of every live LLM replica of the Serve app `app`."""
    import ray

    out = {}
    for info in ray.util.list_named_actors(all_namespaces=True):
        name = info["name"] if isinstance(info, dict) else info
        if name.startswith(f"SERVE_REPLICA::{app}#LLMServer#"):
            out[name.rsplit("#", 1)[-1]] = ray.get_actor(name, namespace="serve")
    return out
