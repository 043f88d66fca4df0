"""k8s/ deployed like a deployment: the RayService's serveConfigV2, byte for byte, through `serve deploy` onto
a local `ray start --head` cluster whose environment is the GPU worker pod's (the ConfigMap, the Secret, the
container's `env` expanded as the kubelet does), against a real redis-server with a password and an S3
endpoint (moto's server). The base model and adapters reach the replicas only through the registry: they are
uploaded with docs/kubernetes.md's `lora-registry` commands and the local model directory is deleted before the
deploy. Ray's token authentication is on, as the manifest's `authOptions` asks (RAY_AUTH_MODE/RAY_AUTH_TOKEN).
What differs from the cluster: the hardware profile (config.yaml's LORASERVE_DEVICE, ...: CPUs here), the
Secret's values, the services' addresses (S3_ENDPOINT_URL, the Redis Service's name) and each volume, which
is a temporary directory."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from tests.deployments.serve_harness import refused_in_proxy
from tests.fixtures.services import free_port, run_redis_server
from tests.k8s.manifest_kit import (HARDWARE_KEYS, REPO, configmap_data, container_env, one, ray_containers,
                                    secret_keys, serve_config)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

CPU_PROFILE = {"LORASERVE_DEVICE": "cpu", "LORASERVE_DTYPE": "float32", "LORASERVE_NUM_GPUS_PER_REPLICA": "0",
               "LORASERVE_NUM_CPUS_PER_REPLICA": "0.5"}
API_KEY = "sk-deploy-test-0001"
ADAPTERS = ("support", "legal")
BIN = Path(sys.executable).parent


def _tiny_model(out: Path) -> Path:
    """A random-weight Llama with a character tokenizer and a chat template, as an HF directory."""
    from transformers import AutoTokenizer

    from tests.engine_ext.char_tokenizer import add_char_tokenizer
    from tests.engine_ext.tiny_models import build_model

    build_model("llama", str(out), seed=0)
    add_char_tokenizer(str(out))
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.save_pretrained(out)
    return out


def _ports(n: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(free_port())
    return sorted(ports)


def _pod_env(tmp: Path, moto: str, redis_url: str, secret_values: dict[str, str]) -> dict[str, str]:
    """The GPU worker container's environment, with this machine's services, volumes and hardware."""
    containers = ray_containers()
    worker = next(c for name, c in containers.items() if name != "head")
    mounts = {m["mountPath"]: tmp / "volumes" / m["name"] for m in worker.get("volumeMounts", [])}
    configmap = dict(configmap_data(), **CPU_PROFILE, S3_ENDPOINT_URL=moto)
    env = container_env(worker, {"loraserve-config": configmap}, {"loraserve-secrets": secret_values})
    head = container_env(containers["head"], {"loraserve-config": configmap}, {"loraserve-secrets": secret_values})
    assert {k: env[k] for k in head} == head  # the builder (head) sees the replicas' registry
    for path, local in mounts.items():
        local.mkdir(parents=True, exist_ok=True)
        env = {k: str(local) + v[len(path):] if v.startswith(path) else v for k, v in env.items()}
    redis = urlparse(redis_url)
    env["REDIS_URL"] = env["REDIS_URL"].replace("loraserve-redis:6379", f"127.0.0.1:{redis.port}")
    base = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "TMPDIR") if k in os.environ}
    ray_auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}  # what authOptions gives pods
    return base | env | ray_auth | {"PYTHONPATH": str(REPO)}


def _cli(env: dict[str, str], *args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "registry.cli", *args], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


class LocalRayCluster:
    """`ray start --head --block` in its own process group, every port free and on loopback, its own temp dir
    (so no other Ray session on the machine finds it); stopped by ending exactly what it started."""

    # `stop` signals the whole group, the GCS with it, so the node's drain on SIGTERM (a GCS call, then a wait for
    # the raylet) could only time out: 30 s by default, the longest part of this test. Ray's own knob; the app
    # never reads it.
    NO_DRAIN = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}

    def __init__(self, env: dict[str, str], num_cpus: int = 4):
        (self.gcs, self.dashboard, self.http, agent, agent_grpc, runtime_env, node_mgr, obj_mgr, client,
         metrics) = _ports(10)
        self.temp_dir = tempfile.mkdtemp(prefix="rs16-", dir="/tmp")  # short: Ray's socket paths are bounded
        self.env = env
        self.log = open(Path(self.temp_dir) / "ray-start.log", "w")
        self.proc = subprocess.Popen(
            [str(BIN / "ray"), "start", "--head", "--block", "--disable-usage-stats", "--node-ip-address=127.0.0.1",
             f"--port={self.gcs}", f"--temp-dir={self.temp_dir}", f"--num-cpus={num_cpus}", "--num-gpus=0",
             "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard}",
             f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
             f"--runtime-env-agent-port={runtime_env}", f"--node-manager-port={node_mgr}",
             f"--object-manager-port={obj_mgr}", f"--ray-client-server-port={client}",
             f"--metrics-export-port={metrics}"],
            env=env | self.NO_DRAIN, cwd=self.temp_dir, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True)

    def wait_ready(self, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, Path(self.log.name).read_text()[-3000:]
            try:
                r = httpx.get(f"http://127.0.0.1:{self.dashboard}/api/version", timeout=2,
                              headers={"Authorization": f"Bearer {self.env['RAY_AUTH_TOKEN']}"})
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"ray start did not come up: {Path(self.log.name).read_text()[-3000:]}")

    def serve(self, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "serve"), *args], env=self.env, cwd=self.temp_dir, capture_output=True,
                              text=True, timeout=timeout_s)

    def stop(self) -> None:
        """SIGTERM to the process group (`ray start --block` stops its node), then SIGKILL to whatever of it is
        left: processes of this group, or of this cluster's temp dir (workers may start their own sessions)."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        for pid in self._own_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.log.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _own_pids(self) -> list[int]:
        pids = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            try:
                cmd = (d / "cmdline").read_bytes().decode(errors="replace")
                pgid = os.getpgid(int(d.name))
            except (OSError, ProcessLookupError):
                continue
            if pgid == self.proc.pid or self.temp_dir in cmd:
                pids.append(int(d.name))
        return pids


def _wait_for_models(base_url: str, want: set[str], cluster: LocalRayCluster, timeout_s: float = 480) -> list:
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{base_url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
            last = f"{r.status_code} {r.text[:300]}"
            if r.status_code == 200 and want <= {m["id"] for m in r.json()["data"]}:
                return r.json()["data"]
        except httpx.HTTPError as e:
            last = repr(e)
        time.sleep(0.5)
    status = cluster.serve("status", "--address", f"http://127.0.0.1:{cluster.dashboard}").stdout
    raise AssertionError(f"/v1/models never listed {sorted(want)}; last answer: {last}\nserve status:\n{status}")


def test_manifest_serve_config_deploys_with_serve_deploy(tmp_path, moto_server):
    import boto3
    from openai import OpenAI

    raw_config, serve_cfg = serve_config()
    (app,) = serve_cfg["applications"]
    model_uri = app["args"]["model"]
    assert model_uri.startswith("registry://")
    base_name = model_uri.removeprefix("registry://")
    assert set(CPU_PROFILE) == set(HARDWARE_KEYS)
    assert one("RayService")["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token"}

    secret_values = {"REDIS_PASSWORD": secrets.token_hex(16), "LORASERVE_ADMIN_TOKEN": secrets.token_hex(16),
                     "LORASERVE_API_KEYS": json.dumps({API_KEY: "acme"}), "AWS_ACCESS_KEY_ID": "testing",
                     "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    assert set(secret_values) == secret_keys()  # every key the Secret has, and no other

    with run_redis_server(password=secret_values["REDIS_PASSWORD"]) as redis_url:
        env = _pod_env(tmp_path, moto_server, redis_url, secret_values)
        boto3.client("s3", endpoint_url=moto_server).create_bucket(Bucket=env["S3_BUCKET"])

        # The operator's steps (docs/kubernetes.md, step 5): the base model's files and the adapters into the registry.
        model_dir = _tiny_model(tmp_path / "model")
        from tests.engine_ext.tiny_models import build_adapter

        for i, name in enumerate(ADAPTERS):
            build_adapter(str(model_dir), str(tmp_path / name), seed=i + 1)
        spec = _cli(env, "base-model", base_name, str(model_dir), "--upload")
        assert spec["blob_location"].startswith(f"s3://{env['S3_BUCKET']}/")
        for name in ADAPTERS:
            assert _cli(env, "push", str(tmp_path / name), "--name", name, "--base-model", base_name,
                        "--activate")["status"] == "active"
        shutil.rmtree(model_dir)  # no pod has the model on a volume

        cluster = LocalRayCluster(env)
        try:
            cluster.wait_ready()
            started = cluster.serve("start", "--address", f"127.0.0.1:{cluster.gcs}", "--http-host", "127.0.0.1",
                                    "--http-port", str(cluster.http))
            assert started.returncode == 0, started.stderr[-3000:]
            config_file = tmp_path / "serve_config.yaml"
            config_file.write_text(raw_config)
            deployed = cluster.serve("deploy", str(config_file), "--address", f"http://127.0.0.1:{cluster.dashboard}")
            assert deployed.returncode == 0, deployed.stderr[-3000:]

            base_url = f"http://127.0.0.1:{cluster.http}"
            want = {base_name, *ADAPTERS}
            listed = _wait_for_models(base_url, want, cluster)
            assert {m["id"] for m in listed} == want

            client = OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
            for model in (ADAPTERS[0], f"{base_name}:{ADAPTERS[1]}", base_name):
                chat = client.chat.completions.create(model=model, max_tokens=6, temperature=0.0,
                                                      messages=[{"role": "user", "content": "hello there"}])
                assert chat.choices[0].message.content is not None and chat.usage.completion_tokens > 0
            # Judged by tokens, not text: most of the random model's 211 ids are outside the 31-character
            # tokenizer and decode to nothing, so six sampled tokens are often empty text.
            chunks = list(client.chat.completions.create(
                model=ADAPTERS[1], max_tokens=6, stream=True, stream_options={"include_usage": True},
                messages=[{"role": "user", "content": "a b c"}]))
            assert any(c.choices and c.choices[0].finish_reason for c in chunks)
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
            assert httpx.get(f"{base_url}/health", timeout=10).status_code == 200  # the pods' probe route
            # The pods' Serve proxies run the prompt guard (config.yaml names it): a prompt too long for the
            # context is refused there, its body never sent to the ingress.
            assert refused_in_proxy(base_url, API_KEY, ADAPTERS[0], 1_000_000) >= 1

            # The replicas fetched the base model from S3 into the pod's cache volume.
            cache = Path(env["LORASERVE_CACHE"]) / "registry" / "materialized" / "_base" / base_name
            assert any((d / "model.safetensors").is_file() for d in cache.iterdir())
            status = cluster.serve("status", "--address", f"http://127.0.0.1:{cluster.dashboard}")
            assert "RUNNING" in status.stdout, status.stdout
        finally:
            cluster.stop()
