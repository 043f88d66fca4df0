"""Registry settings, read from the environment (pydantic-settings). Unset REDIS_URL / S3_BUCKET keep the
embedded defaults: SQLite file + local blob directory under the cache dir."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

__all__ = ["RegistrySettings", "default_cache_dir"]


def default_cache_dir() -> Path:
    return Path(os.environ.get("LORASERVE_CACHE") or Path.home() / ".cache" / "loraserve")


class RegistrySettings(BaseSettings):
    # No env prefix: the names (REDIS_URL, S3_BUCKET, ...) are the ones the deployment manifests use.
    model_config = SettingsConfigDict(env_prefix="", case_sensitive=False, extra="ignore")

    registry_db: Path = Field(default_factory=lambda: default_cache_dir() / "registry" / "registry.db",
                              description="SQLite file (metadata store when REDIS_URL is unset)")
    redis_url: str | None = Field(default=None, description="switches metadata to Redis, e.g. redis://host:6379/0")
    redis_prefix: str = Field(default="loraserve:registry", description="key prefix for all Redis keys")
    s3_bucket: str | None = Field(default=None, description="switches blobs to S3")
    s3_prefix: str = Field(default="blobs", description="key prefix of the content-addressed blobs in the bucket")
    s3_endpoint_url: str | None = Field(default=None, description="custom S3 endpoint (MinIO, moto)")
    store_timeout_s: float = Field(default=5.0, gt=0, description="longest wait to connect to Redis or S3, or for "
                                   "Redis to answer, before the registry counts the store unreachable (a 503)")
    blob_dir: Path = Field(default_factory=lambda: default_cache_dir() / "registry" / "blobs")
    materialize_dir: Path = Field(default_factory=lambda: default_cache_dir() / "registry" / "materialized",
                                  description="local cache the serving layer loads adapter files from")
    allowed_local_roots: Annotated[list[Path], NoDecode] = Field(
        default_factory=lambda: [default_cache_dir() / "incoming"],
        description="registration sources may be directories under these roots (comma-separated in env)")
    upload_dir: Path = Field(default_factory=lambda: default_cache_dir() / "registry" / "uploads",
                             description="where remote pushes stream their files; always an allowed source root")
    upload_ttl_s: float = Field(default=86400.0, gt=0, description=(
        "an upload session not registered yet ends this long after its last file arrived (one that registers ends "
        "then)"))
    max_upload_area_bytes: int = Field(default=8 << 30, ge=1, description=(
        "bytes the upload area holds at most, every session together: a file past it is refused (507)"))
    allowed_s3_prefixes: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="registration sources may be s3://bucket/prefix/... under these")
    max_lora_rank: int = Field(default=64, ge=1)
    max_file_bytes: int = Field(default=1 << 30, ge=1, description="per-file size limit")
    max_total_bytes: int = Field(default=2 << 30, ge=1)
    max_files: int = Field(default=8, ge=1)
    # A safetensors header is JSON describing tensors; a few MB covers tens of thousands of tensors.
    max_header_bytes: int = Field(default=16 << 20, ge=64)
    poll_interval_s: float = Field(default=0.5, gt=0, description="SQLite subscription polling period")
    audit_retention: int = Field(default=1_000_000, ge=1000, description="audit entries kept (globally, and per "
                                                                         "adapter on Redis); older ones are trimmed")
    blob_gc_grace_s: float = Field(default=600.0, ge=0, description="garbage collection spares unreferenced "
                                                                    "blobs written more recently than this")

    @field_validator("allowed_local_roots", "allowed_s3_prefixes", mode="before")
    @classmethod
    def _split_commas(cls, v):
        if isinstance(v, str):
            return [p.strip() for p in v.split(",") if p.strip()]
        return v
