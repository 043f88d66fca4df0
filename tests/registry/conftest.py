"""Registry test fixtures: a tiny random Llama (config + weights), PEFT adapters built on it, and registries
on both backend pairs (SQLite + local dir, Redis + S3 via real redis-server / moto server processes)."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path
from typing import Callable

import pytest

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from registry import Registry, RegistrySettings  # noqa: E402
from registry.blob_store import LocalBlobStore  # noqa: E402
from registry.redis_store import RedisMetadataStore  # noqa: E402
from registry.s3_blob_store import S3BlobStore  # noqa: E402
from registry.sources import SourceFetcher, SourceLimits  # noqa: E402
from registry.sqlite_store import SQLiteMetadataStore  # noqa: E402
from tests.fixtures.services import moto_server, redis_server  # noqa: E402,F401
from tests.registry.adapter_kit import (BACKENDS, BASE, INCOMING_BUCKET, TEST_LIMITS,  # noqa: E402
                                       build_adapter, stage_copy)

@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128)
    out = tmp_path_factory.mktemp("base") / BASE
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def adapter_templates(tiny_base, tmp_path_factory) -> dict[str, Path]:
    """Valid PEFT adapters: 'a' and 'b' (rank 4, different weights), 'r16' (rank 16, above the test limit)."""
    root = tmp_path_factory.mktemp("templates")
    out = {}
    for key, seed, r in (("a", 1, 4), ("b", 2, 4), ("r16", 3, 16)):
        build_adapter(tiny_base, root / key, seed, r)
        out[key] = root / key
    return out


@pytest.fixture(scope="session")
def incoming_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("incoming")


@pytest.fixture
def stage(incoming_root, adapter_templates) -> Callable[..., Path]:
    """stage('a', mutate=fn(dir)) -> a fresh copy of a template under the allowed root, optionally mutated."""
    def _stage(template: str = "a", mutate: Callable[[Path], None] | None = None) -> Path:
        return stage_copy(adapter_templates[template], incoming_root, template, mutate)
    return _stage


@pytest.fixture(scope="session")
def s3_endpoint(moto_server) -> str:
    import boto3

    boto3.client("s3", endpoint_url=moto_server).create_bucket(Bucket=INCOMING_BUCKET)
    return moto_server


@pytest.fixture
def make_registry(request, tmp_path, incoming_root, tiny_base) -> Callable[..., Registry]:
    """make_registry(backend, **settings) -> a fresh, isolated Registry with the tiny base model registered."""
    made: list[Registry] = []

    def _make(backend: str, register_base: bool = True, **overrides) -> Registry:
        tag = uuid.uuid4().hex[:10]
        kwargs = dict(registry_db=tmp_path / f"{tag}.db", blob_dir=tmp_path / f"blobs-{tag}",
                      materialize_dir=tmp_path / f"mat-{tag}", upload_dir=tmp_path / f"uploads-{tag}", allowed_local_roots=[incoming_root],
                      allowed_s3_prefixes=[f"s3://{INCOMING_BUCKET}/uploads/"], poll_interval_s=0.05, **TEST_LIMITS)
        kwargs.update(overrides)
        s3_factory = None
        if backend == "sqlite+local":
            settings = RegistrySettings(**kwargs)
            metadata, blobs = SQLiteMetadataStore(settings.registry_db, settings.poll_interval_s), \
                LocalBlobStore(settings.blob_dir)
        else:
            import boto3

            redis_url = request.getfixturevalue("redis_server")
            endpoint = request.getfixturevalue("s3_endpoint")
            settings = RegistrySettings(redis_url=redis_url, redis_prefix=f"t{tag}", s3_bucket=f"blobs-{tag}",
                                        s3_endpoint_url=endpoint, **kwargs)
            s3_factory = lambda: boto3.client("s3", endpoint_url=endpoint)  # noqa: E731
            s3_factory().create_bucket(Bucket=settings.s3_bucket)
            metadata = RedisMetadataStore(redis_url, settings.redis_prefix)
            blobs = S3BlobStore(s3_factory(), settings.s3_bucket, settings.s3_prefix)
        limits = SourceLimits(settings.max_files, settings.max_file_bytes, settings.max_total_bytes)
        fetcher = SourceFetcher([*settings.allowed_local_roots, settings.upload_dir], settings.allowed_s3_prefixes, limits,
                                s3_factory or (lambda: _moto_client(request)))
        reg = Registry(metadata, blobs, settings, fetcher)
        if register_base:
            reg.register_base_model(BASE, tiny_base, actor="test")
        made.append(reg)
        return reg

    yield _make
    for reg in made:
        reg.close()


def _moto_client(request):
    import boto3

    return boto3.client("s3", endpoint_url=request.getfixturevalue("s3_endpoint"))


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def reg(make_registry, backend) -> Registry:
    return make_registry(backend)


@pytest.fixture(scope="session")
def serve_app():
    """The session's one real Serve app (tests/deployments/serve_harness.py)."""
    from tests.deployments import serve_harness

    app = serve_harness.acquire()
    yield app
    serve_harness.release()
