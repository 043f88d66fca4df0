"""Fetching a set of content-addressed files from the blob store into a local directory, each re-hashed
after download; a marker written last says the directory verified, so a later call reuses it."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from registry.blob_store import BlobStore
from registry.errors import RegistryError
from registry.records import FileEntry
from registry.validation import sha256_file

__all__ = ["materialize_files"]

_VERIFIED_MARKER = ".registry-verified.json"


def materialize_files(blobs: BlobStore, files: dict[str, FileEntry], dest: Path, label: str) -> Path:
    """-> `dest` holding `files` (name -> entry), every byte checked against its sha256. `label` names the
    owner in errors ("adapter x v3", "base model y")."""
    expected = {n: f.model_dump() for n, f in files.items()}
    if _is_verified(dest, expected):
        return dest
    tmp = _temp_dir_beside(dest)
    try:
        for fname, entry in files.items():
            blobs.get(entry.sha256, tmp / fname)
            actual = sha256_file(tmp / fname)
            if actual != entry.sha256:
                raise RegistryError(f"blob for {label} {fname} is corrupt: sha256 {actual} != {entry.sha256}",
                                    code="corrupt_blob")
        (tmp / _VERIFIED_MARKER).write_text(json.dumps(expected, sort_keys=True))
        if dest.exists():  # a stale or concurrent copy: replace it only if it does not verify
            if _is_verified(dest, expected):
                return dest
            shutil.rmtree(dest, ignore_errors=True)
        try:
            os.replace(tmp, dest)
        except OSError:
            if not _is_verified(dest, expected):  # lost a race to another materializer, whose copy verifies
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _temp_dir_beside(dest: Path, attempts: int = 5) -> Path:
    """A new directory next to `dest`. Its parent (materialize_dir/NAME) may be removed between its mkdir and ours:
    `Registry.drop_materialized` of another version removes it when empty. Once the directory is made, the parent
    is not empty and stays."""
    for attempt in range(attempts):
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            return Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}-"))
        except FileNotFoundError:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _is_verified(dest: Path, expected: dict[str, dict]) -> bool:
    """The marker is written only after every file was re-hashed; sizes catch later truncation."""
    try:
        if json.loads((dest / _VERIFIED_MARKER).read_text()) != expected:
            return False
        return all((dest / n).stat().st_size == e["size"] for n, e in expected.items())
    except (OSError, ValueError):
        return False
