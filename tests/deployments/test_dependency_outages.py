"""Outages of the registry's Redis and S3 under the real Serve app (one LLM replica, the quick demo), through the
real processes: a redis-server (append-only file, so it comes back with its data) killed for 15 s and started
again on its port, and moto's S3 server stopped and started again on its port, each under bounded load from the
official `openai` client.

During an outage: no 500; adapters resolved before it keep serving; an adapter that needs what is down gets a
503 with Retry-After; `/ready` says not ready; the app logs a few lines per outage, not one per request. Within
5 s of the dependency's return everything serves again, without a restart. Prints a one-line JSON report."""

from __future__ import annotations

import concurrent.futures as cf
import json
import shutil
import subprocess
import threading
import time
import uuid
from pathlib import Path

import boto3
import httpx
import openai
import pytest

from tests.fixtures.services import free_port

pytestmark = pytest.mark.slow
KEY = "sk-outage-test-key"
APP = "outage"


class Redis:
    """A redis-server that persists every write (appendfsync always): killed and started again, it has its data."""

    def __init__(self, workdir: Path):
        self.port, self.dir, self.proc = free_port(), workdir, None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        import redis

        self.proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1",
                                      "--save", "", "--appendonly", "yes", "--appendfsync", "always",
                                      "--dir", str(self.dir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                redis.Redis.from_url(self.url).ping()
                return
            except redis.RedisError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


class S3:
    """moto's S3 server in this process: stopped and started again on its port, it keeps its buckets."""

    def __init__(self):
        from moto.server import ThreadedMotoServer

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._make = lambda: ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server = None

    def start(self) -> None:
        self.server = self._make()
        self.server.start()

    def stop(self) -> None:
        self.server.stop()


def log_lines(since: dict[Path, int]) -> list[str]:
    """What the app's replica processes logged since `since` (file -> size) beyond Serve's access lines: the
    app's own log lines and any traceback."""
    out = []
    for path, size in since.items():
        with path.open(errors="replace") as f:
            f.seek(size)
            out += [line for line in f if line.strip() and not line.startswith("INFO ")]
    return out


def app_logs() -> dict[Path, int]:
    """file -> size of the stderr of every worker process of the app's replicas (where the app's loggers write)."""
    out = {}
    for path in Path("/tmp/ray/session_latest/logs").glob("worker-*.err"):
        with path.open(errors="replace") as f:
            head = f.read(4096)
        if f":actor_name:ServeReplica:{APP}:" in head:
            out[path] = path.stat().st_size
    return out


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    if shutil.which("redis-server") is None:
        pytest.skip("SKIPPED LOUDLY: redis-server binary missing (apt-get install -y redis-server)")
    from deployments.bootstrap import bootstrap, demo_paths, make_registry, sha256_of_dir
    from deployments.config import load_config
    from tests.deployments.serve_harness import cluster_env, deployed

    cluster_env()
    tmp = tmp_path_factory.mktemp("outage")
    redis, s3 = Redis(tmp), S3()
    redis.start()
    s3.start()
    bucket = f"outage-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=s3.url).create_bucket(Bucket=bucket)
    registry = {"redis_url": redis.url, "redis_prefix": "outage", "s3_bucket": bucket, "s3_endpoint_url": s3.url,
                "materialize_dir": str(tmp / "mat"), "allowed_local_roots": [str(tmp / "in")], "store_timeout_s": 1.0,
                "upload_dir": str(tmp / "uploads")}
    # the tenant's rate limit out of the way: the outage load (four clients in tight loops, a poller) runs at about
    # the default 50 requests/s, and a 429 from the tenant's bucket would read as an outage's refusal
    cfg = bootstrap(load_config({"demo_recipe": "quick", "num_replicas": 1, "num_cpus_per_replica": 0.1,
                                 "ingress_num_cpus": 0.1, "api_keys": {KEY: "acme"}, "registry": registry,
                                 "tenant_rates": {"acme": {"rate": 1e6, "burst": 1e6}}}, env={}))
    reg = make_registry(cfg)
    demo = demo_paths(cfg)["adapters"]
    for name in ("fresh-redis", "fresh-s3"):  # never asked for before its outage
        src = tmp / "in" / name
        shutil.copytree(demo[sorted(demo)[1]], src)
        reg.register(name, str(src), sha256_of_dir(src), cfg.base_model_name, actor="test", activate=True)
    reg.close()
    try:
        with deployed(cfg, APP, f"/{APP}") as url:
            yield url, cfg.base_model_name, sorted(demo)[0], redis, s3
    finally:
        if redis.proc.poll() is None:
            redis.kill()
        s3.stop()


def run_outage(url: str, base: str, known: str, fresh: str, down, up, seconds: float) -> dict:
    """Bounded load (3 clients on a resolved adapter, 1 on `fresh`, one /ready poller) while `down()`..`up()`."""
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    stop, results = threading.Event(), {"known": [], "fresh": [], "ready": [], "models": []}

    def ask(model: str, bucket: str) -> None:
        while not stop.is_set():
            try:
                client.completions.create(model=f"{base}:{model}", prompt="def add(a, b):", max_tokens=4)
                results[bucket].append((time.monotonic(), 200, None))
            except openai.APIStatusError as e:
                results[bucket].append((time.monotonic(), e.status_code, e.response.headers.get("retry-after")))
            time.sleep(0.05)

    def poll() -> None:
        while not stop.is_set():
            results["ready"].append((time.monotonic(), httpx.get(url + "/ready", timeout=10).status_code, None))
            results["models"].append((time.monotonic(), httpx.get(url + "/v1/models", timeout=10, headers={
                "Authorization": f"Bearer {KEY}"}).status_code, None))
            time.sleep(0.2)

    since = app_logs()
    with cf.ThreadPoolExecutor(5) as pool:
        futures = [pool.submit(ask, known, "known") for _ in range(3)] + [pool.submit(ask, fresh, "fresh"),
                                                                          pool.submit(poll)]
        down()
        t0 = time.monotonic()
        time.sleep(seconds)
        up()
        back = time.monotonic()
        # what was asked once the dependency was gone (a request already past the store when it went is not)
        during = {k: [(st, h) for t, st, h in v if t0 + 0.5 < t < back] for k, v in results.items()}
        while time.monotonic() - back < 30:  # until the adapter that needed the dependency serves
            try:
                client.completions.create(model=f"{base}:{fresh}", prompt="x", max_tokens=1)
                if httpx.get(url + "/ready", timeout=10).status_code == 200:
                    break
            except openai.APIStatusError:
                pass
            time.sleep(0.1)
        recovered_s = time.monotonic() - back
        stop.set()
        for f in futures:
            f.result()
    lines = log_lines(since)
    return {"during": during, "all": results, "recovered_s": recovered_s, "outage_s": back - t0, "log_lines": lines}


def summary(r: dict) -> dict:
    count = lambda xs: {str(s): sum(1 for x in xs if x[0] == s) for s in sorted({x[0] for x in xs})}  # noqa: E731
    return {k: count(v) for k, v in r["during"].items()} | {"recovered_s": round(r["recovered_s"], 2),
                                                             "outage_s": round(r["outage_s"], 1),
                                                             "log_lines": len(r["log_lines"])}


def check(r: dict) -> None:
    statuses = [st for v in r["all"].values() for _, st, _ in v]
    assert 500 not in statuses and statuses, summary(r)
    during = r["during"]
    assert during["known"] and all(s == 200 for s, _ in during["known"]), summary(r)  # resolved before: served
    assert during["fresh"] and all(s == 503 and int(h) >= 1 for s, h in during["fresh"]), summary(r)
    assert (503, None) in during["ready"], summary(r)
    assert r["recovered_s"] < 5, summary(r)
    # a line when it went and one when it came back, per process that noticed: a few, not one per request
    assert any("unreachable" in line for line in r["log_lines"]) and len(r["log_lines"]) <= 10, r["log_lines"]
    assert not [line for line in r["log_lines"] if "Traceback" in line], r["log_lines"]


def test_a_redis_outage_keeps_resolved_adapters_serving_and_recovers(app):
    url, base, known, redis, _ = app
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    client.completions.create(model=f"{base}:{known}", prompt="x", max_tokens=2)  # resolved and loaded
    httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    r = run_outage(url, base, known, "fresh-redis", redis.kill, redis.start, 15.0)
    print("\nredis outage:", json.dumps(summary(r)))
    check(r)
    assert all(s == 200 for s, _ in r["during"]["models"]), summary(r)  # the last listing stood in


def test_an_s3_outage_refuses_only_adapters_whose_files_must_be_fetched(app):
    url, base, known, _, s3 = app
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    client.completions.create(model=f"{base}:{known}", prompt="x", max_tokens=2)
    r = run_outage(url, base, known, "fresh-s3", s3.stop, s3.start, 8.0)
    print("\ns3 outage:", json.dumps(summary(r)))
    check(r)
