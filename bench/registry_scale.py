"""Control-plane reads at 1,000 to 20,000 adapters, on SQLite and on a real redis-server: a listing page of 100,
`/v1/models` at the ingress, the audit by adapter name, and the per-request resolver alone and while
`/v1/models` is polled 20 times a second. Prints one JSON object.

Adapters are written through the metadata store's commit path (one commit per adapter: version 1 registered and
promoted), all citing the same two blobs: this measures the reads, not file validation. One adapter ("hot") gets
60 audit entries so the by-name audit has something to page through.

    python bench/registry_scale.py                          # 1,000 / 5,000 / 20,000, both backends
    python bench/registry_scale.py --scales 1000 20000 --backends sqlite
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import asyncio  # noqa: E402

import httpx  # noqa: E402

from deployments.data_plane.openai_api import IngressDeps, create_openai_app  # noqa: E402
from deployments.data_plane.rate_limit import ColdLoadGate, RateLimiter  # noqa: E402
from registry import AdapterDisabled, AdapterNotFound, Registry, RegistrySettings, lifecycle  # noqa: E402
from registry.api import create_app  # noqa: E402
from registry.blob_store import LocalBlobStore  # noqa: E402
from registry.metadata_store import Mutation  # noqa: E402
from registry.records import AdapterRecord, AdapterState, AuditEntry, FileEntry  # noqa: E402

BASE = "bench-base"
FILES = {"adapter_config.json": FileEntry(sha256="a" * 64, size=600),
         "adapter_model.safetensors": FileEntry(sha256="b" * 64, size=1 << 20)}


def _register_active(store, name: str, tenant: str | None) -> None:
    def mutate(before):
        rec = AdapterRecord(name=name, version=1, base_model=BASE, rank=16, alpha=32.0, dtype="BF16", files=FILES,
                            owner_tenant=tenant, visibility="tenant" if tenant else "public", status="ready",
                            target_modules=["q_proj", "v_proj"], source_uri=f"s3://in/{name}")
        state = lifecycle.promote(lifecycle.add_version(AdapterState(name=name, owner_tenant=tenant), rec), 1)
        return Mutation(state=state, audit=AuditEntry(seq=0, ts=time.time(), actor="bench", action="register",
                                                      name=name, version=1, after=state.head()))
    store.update(name, mutate)


def _timed(fn, reps: int) -> dict:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {"p50_ms": round(statistics.median(times), 3), "p99_ms": round(times[min(len(times) - 1, int(0.99 * len(times)))], 3)}


class AsgiClient:
    """Requests straight into an ASGI app (httpx's ASGI transport) on an event loop of its own: what is timed is
    the app, not a test client's per-request thread portal (about 10 ms on the loaded 2-core machine)."""

    def __init__(self, app):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bench")

    def get(self, path: str, **kw) -> httpx.Response:
        return asyncio.run_coroutine_threadsafe(self._client.get(path, **kw), self._loop).result()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._client.aclose(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()


def _ok(resp):
    assert resp.status_code == 200, resp.text
    return resp


def measure(reg: Registry, n: int, reps: int) -> dict:
    admin = AsgiClient(create_app(reg, {"adm": {"role": "admin", "name": "bench"}}))
    deps = IngressDeps(base_name=BASE, api_keys={"sk": "acme"}, resolver=reg, llm=None,
                       limiter=RateLimiter((1e9, 1e9), (1e9, 1e9)), gate=ColdLoadGate(),
                       registry_errors=(AdapterNotFound, AdapterDisabled))
    ingress = AsgiClient(create_openai_app(deps))
    h_admin, h_key = {"Authorization": "Bearer adm"}, {"Authorization": "Bearer sk"}
    cursor = f"ad-{n // 2:06d}"
    out = {"adapters": n}
    page = _ok(admin.get("/v1/adapters", headers=h_admin, params={"limit": 100, "cursor": cursor})).json()
    assert len(page["items"]) == 100
    out["list_page_100"] = _timed(lambda: _ok(admin.get("/v1/adapters", headers=h_admin,
                                                        params={"limit": 100, "cursor": cursor})), reps)
    t0 = time.perf_counter()
    models = _ok(ingress.get("/v1/models", headers=h_key)).json()["data"]
    out["models_first_call_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
    out["models_listed"] = len(models) - 1
    out["v1_models"] = _timed(lambda: _ok(ingress.get("/v1/models", headers=h_key)), reps)
    audit = _ok(admin.get("/v1/audit", headers=h_admin, params={"name": "hot", "limit": 100})).json()
    assert len(audit) == 61 and audit[0]["seq"] > audit[-1]["seq"]  # all of hot's entries, newest first
    out["audit_by_name_100"] = _timed(lambda: _ok(admin.get("/v1/audit", headers=h_admin,
                                                            params={"name": "hot", "limit": 100})), reps)
    rng = random.Random(0)
    names = [f"ad-{rng.randrange(n):06d}" for _ in range(20 * reps)]
    it = iter(names * 3)
    out["resolve_alone"] = _timed(lambda: reg.resolve(next(it), "acme", "r"), len(names))
    stop = threading.Event()

    def poller():  # a client polling /v1/models 20 times a second beside the resolver
        while not stop.wait(0.05):
            ingress.get("/v1/models", headers=h_key)

    thread = threading.Thread(target=poller, daemon=True)
    thread.start()
    try:
        out["resolve_during_v1_models"] = _timed(lambda: reg.resolve(next(it), "acme", "r"), len(names))
    finally:
        stop.set()
        thread.join()
        admin.close()
        ingress.close()
    return out


def run_backend(backend: str, scales: list[int], reps: int, redis_url: str | None, workdir: Path) -> list[dict]:
    settings = RegistrySettings(registry_db=workdir / f"{backend}.db", blob_dir=workdir / "blobs",
                                materialize_dir=workdir / "mat", upload_dir=workdir / "up",
                                allowed_local_roots=[workdir], redis_url=redis_url if backend == "redis" else None,
                                redis_prefix=f"bench{os.getpid()}")
    if backend == "redis":
        from registry.redis_store import RedisMetadataStore
        store = RedisMetadataStore(redis_url, settings.redis_prefix)
    else:
        from registry.sqlite_store import SQLiteMetadataStore
        store = SQLiteMetadataStore(settings.registry_db, settings.poll_interval_s)
    reg = Registry(store, LocalBlobStore(settings.blob_dir), settings, fetcher=None)
    _register_active(store, "hot", None)
    for _ in range(60):
        reg.disable("hot") if not reg.get("hot").disabled else reg.enable("hot")
    results, have = [], 0
    for n in scales:
        t0 = time.perf_counter()
        for i in range(have, n):
            _register_active(store, f"ad-{i:06d}", "acme" if i % 10 == 0 else None)
        have = n
        fill_s = time.perf_counter() - t0
        row = {"backend": backend, **measure(reg, n, reps), "fill_s": round(fill_s, 1)}
        print(json.dumps(row), file=sys.stderr, flush=True)
        results.append(row)
    reg.close()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scales", type=int, nargs="+", default=[1000, 5000, 20000])
    p.add_argument("--backends", nargs="+", default=["sqlite", "redis"], choices=["sqlite", "redis"])
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--redis-url", help="an existing redis (else a redis-server is started on a free port)")
    args = p.parse_args()
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="registry-scale-")))
        redis_url = args.redis_url
        if "redis" in args.backends and not redis_url:
            from tests.fixtures.services import run_redis_server
            redis_url = stack.enter_context(run_redis_server())
        rows = [r for b in args.backends for r in run_backend(b, sorted(args.scales), args.reps, redis_url, workdir)]
    print(json.dumps({"machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.python_version()}",
                      "results": rows}, indent=1))


if __name__ == "__main__":
    main()
