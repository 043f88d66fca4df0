"""Fetching a registration's files from its source into a private staging directory.

Only two kinds of source exist: a directory under an allowed local root, or an s3://bucket/prefix/ "directory"
under an allowed S3 prefix. Everything else (http://, file://, relative paths, `..`, symlinks leading out of the
root, nested directories) is refused before a byte is read. Size and count limits are checked from metadata
(stat / ListObjects) before copying, and again while copying, since a file can grow in between.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable

from registry.errors import RegistryValidationError, SourceNotAllowed

__all__ = ["SourceLimits", "SourceFetcher", "parse_s3_uri", "FILE_NAME_PATTERN"]

FILE_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class SourceLimits:
    max_files: int
    max_file_bytes: int
    max_total_bytes: int


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """'s3://bucket/a/b' -> ('bucket', 'a/b')."""
    rest = uri[len("s3://"):]
    bucket, _, key = rest.partition("/")
    return bucket, key


def _check_limits(sizes: dict[str, int], limits: SourceLimits) -> None:
    if not sizes:
        raise RegistryValidationError("source directory is empty", code="missing_file")
    if len(sizes) > limits.max_files:
        raise RegistryValidationError(f"too many files: {len(sizes)} > limit {limits.max_files}", code="too_many_files")
    for name, size in sizes.items():
        if size > limits.max_file_bytes:
            raise RegistryValidationError(
                f"file {name} is oversize: {size} bytes > limit {limits.max_file_bytes}", code="file_too_large")
    if sum(sizes.values()) > limits.max_total_bytes:
        raise RegistryValidationError(
            f"total size {sum(sizes.values())} bytes > limit {limits.max_total_bytes}", code="file_too_large")


def _check_file_name(name: str) -> None:
    if not FILE_NAME_PATTERN.match(name):
        raise RegistryValidationError(f"invalid file name {name!r} in source", code="invalid_file_name")


def _bounded_copy(src: BinaryIO, dst_path: Path, name: str, limit: int) -> None:
    written = 0
    with dst_path.open("wb") as dst:
        while chunk := src.read(_CHUNK):
            written += len(chunk)
            if written > limit:
                raise RegistryValidationError(f"file {name} is oversize: grew beyond limit {limit} bytes while copying",
                                              code="file_too_large")
            dst.write(chunk)


class SourceFetcher:
    def __init__(self, allowed_local_roots: list[Path], allowed_s3_prefixes: list[str], limits: SourceLimits,
                 s3_client_factory: Callable[[], Any] | None = None):
        self._roots = [Path(os.path.realpath(r)) for r in allowed_local_roots]
        self._s3_prefixes = [p if p.endswith("/") else p + "/" for p in allowed_s3_prefixes]
        self._limits = limits
        self._s3_client_factory = s3_client_factory

    def fetch(self, uri: str, dest: Path) -> dict[str, Path]:
        """Copy the source's files into `dest` (an empty private dir) -> {file name: staged path}."""
        if not isinstance(uri, str) or not uri:
            raise SourceNotAllowed("source_uri is empty", code="source_not_allowed")
        if "\x00" in uri:
            raise SourceNotAllowed("source_uri contains a NUL byte", code="source_not_allowed")
        scheme, sep, _ = uri.partition("://")
        if sep and scheme == "s3":
            from botocore.exceptions import ClientError  # S3 sources only: the local path needs no AWS SDK

            try:
                return self._fetch_s3(uri, dest)
            except ClientError as e:  # no such bucket/key, access denied: the registrant's source is at fault
                raise RegistryValidationError(f"cannot read source {uri!r}: {e}", code="source_unreadable") from e
        if sep or uri.lower().startswith("file:"):
            raise SourceNotAllowed(f"source scheme {scheme!r} is not allowed; use s3:// or a local path "
                                   f"under an allowed root", code="scheme_not_allowed")
        try:
            return self._fetch_local(uri, dest)
        except OSError as e:  # name too long, permission denied, vanished mid-copy
            raise RegistryValidationError(f"cannot read source {uri!r}: {e.strerror or e}",
                                          code="source_unreadable") from e

    # -- local ---------------------------------------------------------------------------------------------
    def _root_of(self, real: Path) -> Path | None:
        return next((r for r in self._roots if real == r or real.is_relative_to(r)), None)

    def _fetch_local(self, uri: str, dest: Path) -> dict[str, Path]:
        path = Path(uri)
        if not path.is_absolute():
            raise SourceNotAllowed(f"local source {uri!r} must be an absolute path under an allowed root "
                                   f"{[str(r) for r in self._roots]}", code="source_not_allowed")
        if ".." in path.parts:
            raise SourceNotAllowed(f"path traversal ('..') in source {uri!r}", code="path_traversal")
        real = Path(os.path.realpath(path))
        root = self._root_of(real)
        if root is None:
            raise SourceNotAllowed(f"source {uri!r} resolves outside the allowed local roots "
                                   f"{[str(r) for r in self._roots]}", code="path_traversal")
        if not real.is_dir():
            raise RegistryValidationError(f"source {uri!r} is not a directory", code="missing_file")
        entries: dict[str, Path] = {}
        for entry in sorted(real.iterdir()):
            _check_file_name(entry.name)
            target = Path(os.path.realpath(entry))
            # A symlink is followed only if it stays inside the same allowed root.
            if not target.is_relative_to(root):
                raise SourceNotAllowed(f"file {entry.name} is a symlink leading out of the allowed root",
                                       code="path_traversal")
            if not target.is_file():
                raise RegistryValidationError(f"{entry.name} is not a regular file (nested directories are not allowed)",
                                              code="invalid_file_name")
            entries[entry.name] = target
        _check_limits({n: p.stat().st_size for n, p in entries.items()}, self._limits)
        staged = {}
        for name, src in entries.items():
            with src.open("rb") as f:
                _bounded_copy(f, dest / name, name, self._limits.max_file_bytes)
            staged[name] = dest / name
        return staged

    # -- s3 ------------------------------------------------------------------------------------------------
    def _fetch_s3(self, uri: str, dest: Path) -> dict[str, Path]:
        bucket, key = parse_s3_uri(uri)
        if any(seg in ("..", ".") for seg in key.split("/")) or "//" in key.rstrip("/"):
            raise SourceNotAllowed(f"path traversal in source {uri!r}", code="path_traversal")
        directory = f"s3://{bucket}/{key.rstrip('/')}/"
        if not any(directory.startswith(p) for p in self._s3_prefixes):
            raise SourceNotAllowed(f"bucket/prefix of {uri!r} is not allowed (allowed: {self._s3_prefixes})",
                                   code="bucket_not_allowed")
        if self._s3_client_factory is None:
            raise SourceNotAllowed("S3 sources are not configured", code="bucket_not_allowed")
        client = self._s3_client_factory()
        prefix = key.rstrip("/") + "/"
        sizes: dict[str, int] = {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                name = obj["Key"][len(prefix):]
                if "/" in name:
                    raise RegistryValidationError(f"nested object {obj['Key']!r} under the source is not allowed",
                                                  code="invalid_file_name")
                _check_file_name(name)
                sizes[name] = obj["Size"]
                if len(sizes) > self._limits.max_files:
                    _check_limits(sizes, self._limits)
        _check_limits(sizes, self._limits)
        staged = {}
        for name in sizes:
            body = client.get_object(Bucket=bucket, Key=prefix + name)["Body"]
            try:
                _bounded_copy(body, dest / name, name, self._limits.max_file_bytes)
            finally:
                body.close()
            staged[name] = dest / name
        return staged
