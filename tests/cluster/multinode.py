"""A real multi-node Ray cluster on one machine, running the Serve app as a cluster would: a head (Serve's
controller, the HTTP proxy, the ingress) and worker nodes that each advertise one `llm_slot`, so the LLM
replicas (`replica_resources: {"llm_slot": 1}`) spread one per worker node; the registry on a real Redis and
S3 (moto's server). `ray.cluster_utils.Cluster` starts each node's raylet as Ray's own Serve tests do; removing a
node kills its raylet and every process on it.

The cluster has its own temp dir and ports, so other Ray clusters on this machine (another test session's
`ray.init()`) neither see nor join it. Used by the scenarios in `tests/cluster/scenarios.py`, which run in a
process of their own (a driver connects to one cluster for its life).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import tempfile
import time
import uuid
from unittest import mock
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

SLOT = "llm_slot"  # the custom resource of a worker node: one LLM replica per node
APP = "loraserve"
KEY = "sk-multinode-0001"
ADMIN = "multinode-admin-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cluster(root: Path, head_cpus: int = 2):
    """A head node (no LLM slot) with its own temp dir and ports; -> the `Cluster`, connected."""
    import ray
    from ray.cluster_utils import Cluster

    from deployments.data_plane import proxy_guard

    proxy_guard.install(os.environ)  # every node's proxy, as `serve run deployments.app` and k8s/ name it
    temp_dir = Path(tempfile.mkdtemp(prefix="rmn-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    (root / "ray_temp_dir").write_text(str(temp_dir))
    # `Cluster` writes its address to /tmp/ray/ray_current_cluster, where any `ray.init()` without an address on
    # this machine (another session's tests) would find it and join it; this cluster is known by its address only.
    with mock.patch.object(ray._private.utils, "write_ray_address", lambda *args, **kwargs: None):
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": head_cpus, "temp_dir": str(temp_dir), "include_dashboard": False,
            "gcs_server_port": free_port(), "ray_client_server_port": free_port(),
            "dashboard_agent_listen_port": free_port(), "object_store_memory": 100 * 2**20,
        })
    ray.init(address=cluster.address, log_to_driver=False)
    return cluster


def add_worker(cluster, slots: int = 1):
    """A worker node with `slots` LLM slots and no CPUs to schedule on (nothing but LLM replicas lands there)."""
    return cluster.add_node(num_cpus=0, resources={SLOT: slots}, object_store_memory=80 * 2**20,
                            temp_dir=cluster.head_node.get_temp_dir_path())


def pid_of_actor(actor) -> int:
    def pid(_self):  # nested: cloudpickle ships it by value
        import os

        return os.getpid()

    return _call(actor, pid)


def kill_node(cluster, node, actor_pids: list[int]) -> None:
    """Lose `node` as a reclaimed machine is lost: every process on it SIGKILLed at once (its raylet, the
    workers the raylet started and `actor_pids`, actors forked by the node's warm start server rather than by the
    raylet), then the node taken out of `cluster`'s books. (`Cluster.remove_node` alone kills the raylet first and
    leaves the workers to notice, which lets a replica finish its streams.)"""
    import os
    import signal

    import psutil
    from ray._private import ray_constants

    raylet = psutil.Process(node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid)
    victims = [*actor_pids, *(p.pid for p in raylet.children(recursive=True)), raylet.pid]
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    cluster.remove_node(node, allow_graceful=False)


def stop_cluster(cluster, root: Path) -> None:
    import ray

    try:
        ray.shutdown()
    finally:
        cluster.shutdown()
        temp = root / "ray_temp_dir"
        if temp.exists():
            shutil.rmtree(temp.read_text(), ignore_errors=True)


def cluster_config(root: Path, redis_url: str, s3_endpoint: str, **overrides):
    """The app's config for the cluster: Redis + S3 registry, one replica per LLM slot, the toy demo model;
    -> (bootstrapped AppConfig, the S3 bucket)."""
    import boto3

    from deployments.bootstrap import bootstrap
    from deployments.config import load_config

    bucket = f"mn-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=bucket)
    (root / "in").mkdir(exist_ok=True)
    args = {
        "demo_recipe": "quick", "num_replicas": 3, "replica_resources": {SLOT: 1}, "num_cpus_per_replica": 0,
        "ingress_num_cpus": 0.25, "max_loras": 8, "max_cpu_loras": 16, "max_ongoing_requests": 16,
        "routing_stats_period_s": 0.5, "placement_period_s": 0.5, "api_keys": {KEY: "mn"}, "admin_token": ADMIN,
        "tenant_rate": {"rate": 1e6, "burst": 1e6}, "adapter_rate": {"rate": 1e6, "burst": 1e6},
        "cold_load_wait_s": 60,
        "registry": {"redis_url": redis_url, "redis_prefix": f"mn:{uuid.uuid4().hex[:8]}", "s3_bucket": bucket,
                     "s3_endpoint_url": s3_endpoint, "materialize_dir": str(root / "mat"),
                     "allowed_local_roots": [str(root / "in")], "poll_interval_s": 0.2},
        **overrides,
    }
    return bootstrap(load_config(args, env={})), bucket


def _distinct_weights(adapter_dir: Path, seed: int) -> None:
    """Replace the adapter's B matrices with seeded noise: each (adapter, version) then answers a prompt with its
    own greedy text, so an answer from the wrong adapter or version shows in the text."""
    import torch
    from safetensors.torch import load_file, save_file

    path = adapter_dir / "adapter_model.safetensors"
    tensors = load_file(str(path))
    gen = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if "lora_B" in name:
            tensors[name] = (torch.randn(t.shape, generator=gen) * 0.5).to(t.dtype)
    save_file(tensors, str(path))


def register_adapters(cfg, root: Path, names: list[str], old_versions: tuple[str, ...] = ()) -> dict[str, str]:
    """Register each of `names` (the demo adapter's shapes, weights of its own), active; those in `old_versions`
    first get a version 1 that is no longer served. -> name -> the key that must answer ('name@version')."""
    from deployments.bootstrap import demo_paths, make_registry, sha256_of_dir

    demo = demo_paths(cfg)["adapters"]
    source = demo[sorted(demo)[0]]
    reg = make_registry(cfg)
    keys = {}
    try:
        for i, name in enumerate(names):
            for old in ((True, False) if name in old_versions else (False,)):
                d = root / "in" / f"{name}-{'old' if old else 'new'}"
                shutil.copytree(source, d)
                _distinct_weights(d, seed=2 * i + (0 if old else 1))
                rec = reg.register(name, str(d), sha256_of_dir(d), cfg.base_model_name, actor="test",
                                   activate=True)  # a second version takes over from the first
            keys[name] = f"{name}@{rec.version}"
    finally:
        reg.close()
    return keys


def start_serve() -> str:
    """Serve on the cluster, HTTP on the head only (one proxy: the nodes share this machine's ports), on a free
    port; -> its base URL."""
    from ray import serve

    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    return f"http://127.0.0.1:{port}"


def deploy(cfg) -> None:
    """The app from `cfg` as `APP` at /, replacing one deployed before."""
    from ray import serve

    from deployments.application import bind_app

    serve.run(bind_app(cfg), name=APP, route_prefix="/")


# ---------------------------------------------------------------------------------------------- the app's state
def llm_replicas() -> dict[str, Any]:
    """replica id -> actor handle of every LLM replica actor alive now."""
    import ray

    out = {}
    for info in ray.util.list_named_actors(all_namespaces=True):
        name = info["name"] if isinstance(info, dict) else info
        if name.startswith(f"SERVE_REPLICA::{APP}#LLMServer#"):
            try:
                out[name.rsplit("#", 1)[-1]] = ray.get_actor(name, namespace="serve")
            except ValueError:  # gone between listing and asking
                continue
    return out


def _call(actor, fn, timeout: float = 5.0):
    import ray

    return ray.get(actor.__ray_call__.remote(fn), timeout=timeout)


def node_of_actor(actor) -> Optional[str]:
    """The node id an actor runs on (asked in the actor)."""
    def node(_self):  # nested: cloudpickle ships it by value
        import ray

        return ray.get_runtime_context().get_node_id()

    try:
        return _call(actor, node)
    except Exception:  # noqa: BLE001 - an actor on a lost node
        return None


def serve_actor_nodes() -> dict[str, str]:
    """Serve actor name -> node id, for every Serve actor that answers."""
    import ray

    out = {}
    for info in ray.util.list_named_actors(all_namespaces=True):
        name = info["name"] if isinstance(info, dict) else info
        if info.get("namespace") == "serve" and name.startswith("SERVE"):
            try:
                node = node_of_actor(ray.get_actor(name, namespace="serve"))
            except ValueError:
                continue
            if node is not None:
                out[name] = node
    return out


def replica_stats(timeout: float = 3.0) -> dict[str, dict]:
    """replica id -> routing stats and engine adapter loads of every LLM replica that answers within `timeout`."""
    import ray

    def stats(replica_actor):  # nested: cloudpickle ships it by value
        deployment = replica_actor._replica_impl._user_callable_wrapper.user_callable
        if deployment is None or not hasattr(deployment, "server"):  # still starting
            return None
        server = deployment.server
        out = server.record_routing_stats()
        out["loads"] = sum(int(a.get("loads", 0)) for a in (server.stats.latest.get("adapters") or {}).values())
        out["known"] = server.adapters.known()
        out["registered_by"] = server.adapters.registered_by()
        out["homes"] = server.placement.homes()  # the plan's share this replica acts on now
        return out

    refs = {rid: a.__ray_call__.remote(stats) for rid, a in llm_replicas().items()}
    out = {}
    for rid, ref in refs.items():
        try:
            stats_of = ray.get(ref, timeout=timeout)
        except Exception:  # noqa: BLE001 - a replica on a lost node
            continue
        if stats_of is not None:
            out[rid] = stats_of
    return out


def placement_view(base_url: str) -> dict:
    import httpx

    return httpx.get(f"{base_url}/admin/v1/placement", headers={"Authorization": f"Bearer {ADMIN}"},
                     timeout=30).json()


def running_replicas() -> int:
    from ray import serve

    return serve.status().applications[APP].deployments["LLMServer"].replica_states.get("RUNNING", 0)


def wait_for(pred: Callable[[], Any], timeout: float, period: float = 0.5):
    """`pred()`'s first truthy value within `timeout` seconds, else None."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            return None
        time.sleep(period)


# ---------------------------------------------------------------------------------------------- load
PROMPTS = ["def add(a, b):\n", "import os\n", "class Stack:\n", "for i in range(10):\n"]


@dataclass
class Outcome:
    adapter: str  # the model asked for: the base model's name or an adapter's
    prompt: int
    stream: bool
    kind: str  # ok | error_event (a stream ended with an error event) | failed (an HTTP error) | hung | dropped
    served_as: Optional[str] = None  # x-loraserve-adapter: name@version that answered
    replica: Optional[str] = None
    retries: int = 0
    text: str = ""
    code: Optional[str] = None  # the error's code
    tokens: int = 0  # stream: deltas received before the end
    started: float = 0.0  # monotonic
    ended: float = 0.0

    def to_json(self) -> dict:
        return self.__dict__.copy()


@dataclass
class Load:
    """Bounded closed-loop load through the official `openai` client: `requests` from `concurrency` workers, each
    request (model, prompt, stream) taken in turn from `plan`; every outcome recorded."""

    base_url: str
    plan: list[tuple[str, int, bool]]
    concurrency: int
    max_tokens: int = 24
    stream_timeout_s: float = 90.0  # a stream that has not ended by then counts as hung
    outcomes: list[Outcome] = field(default_factory=list)
    in_flight: dict[int, Outcome] = field(default_factory=dict)  # id -> the outcome of a request not yet ended

    async def run(self) -> list[Outcome]:
        import httpx
        import openai

        queue: asyncio.Queue = asyncio.Queue()
        for item in self.plan:
            queue.put_nowait(item)
        http = httpx.AsyncClient(timeout=self.stream_timeout_s, limits=httpx.Limits(max_connections=64))
        client = openai.AsyncOpenAI(base_url=self.base_url + "/v1", api_key=KEY, max_retries=0,
                                    timeout=self.stream_timeout_s, http_client=http)

        async def worker():
            while not queue.empty():
                model, prompt, stream = queue.get_nowait()
                out = Outcome(model, prompt, stream, "ok", started=time.monotonic())
                self.in_flight[id(out)] = out
                try:
                    await asyncio.wait_for(self._one(client, out), self.stream_timeout_s)
                except asyncio.TimeoutError:
                    out.kind = "hung"
                out.ended = time.monotonic()
                del self.in_flight[id(out)]
                self.outcomes.append(out)

        try:
            await asyncio.gather(*(worker() for _ in range(self.concurrency)))
        finally:
            await http.aclose()
        return self.outcomes

    async def _one(self, client, out: Outcome) -> None:
        import openai

        try:
            raw = await client.completions.with_raw_response.create(
                model=out.adapter, prompt=PROMPTS[out.prompt], max_tokens=self.max_tokens, temperature=0,
                stream=out.stream)
            out.served_as = raw.headers.get("x-loraserve-adapter")
            out.replica = raw.headers.get("x-loraserve-replica")
            out.retries = int(raw.headers.get("x-loraserve-retries", 0))
            body = raw.parse()  # the legacy raw response: parse() is not a coroutine
            if out.stream:
                parts = []
                async for chunk in body:
                    if chunk.choices and chunk.choices[0].text:
                        parts.append(chunk.choices[0].text)
                        out.tokens += 1
                out.text = "".join(parts)
            else:
                out.text = body.choices[0].text
        except openai.APIError as e:
            if out.stream and out.served_as is not None:  # the stream had begun: an error event ended it
                out.kind = "error_event"
            else:
                out.kind = "failed"
            body = getattr(e, "body", None)
            out.code = getattr(e, "code", None) or (body.get("code") if isinstance(body, dict) else None)
        except Exception as e:  # noqa: BLE001 - a dropped connection: what must not happen
            out.kind = f"dropped:{type(e).__name__}"
            out.code = str(e)[:200]


def summarize(outcomes: list[Outcome]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for o in outcomes:
        key = f"{'stream' if o.stream else 'unary'}:{o.kind}"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def dump(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=1, default=str))
