"""The control plane's upload area: a remote `lora-registry push` streams each file into
`{upload_dir}/{upload_id}/`, which is an allowed source root, then registers that directory like any other.

The client derives `upload_id` from the files' hashes, so a retried push lands in the same directory and files
already there with the right hash are skipped. A file is written under a temporary name, hashed while it
streams, size-capped, and renamed into place only when its sha256 matches: a directory never shows a partial or
wrong file. Uploads untouched for `ttl_s` are removed when a new one starts (their files were copied into the
blob store when registered, or never registered).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import AsyncIterator

from pydantic import BaseModel, Field

from registry.errors import RegistryValidationError
from registry.validation import sha256_file

__all__ = ["UploadArea", "UploadStatus"]


class UploadStatus(BaseModel):
    source_uri: str = Field(description="register with this source_uri once every file is uploaded")
    files: dict[str, str] = Field(description="file name -> sha256 of the files uploaded so far")


class UploadArea:
    ID_PATTERN = r"^[A-Za-z0-9_-]{8,64}$"
    FILE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"

    def __init__(self, root: Path, max_files: int, max_file_bytes: int, ttl_s: float = 86400.0):
        self._root = Path(root)
        self._max_files = max_files
        self._max_file_bytes = max_file_bytes
        self._ttl_s = ttl_s

    def _prune(self) -> None:
        cutoff = time.time() - self._ttl_s
        for d in self._root.iterdir():
            try:
                if d.is_dir() and d.stat().st_mtime < cutoff:
                    shutil.rmtree(d, ignore_errors=True)
            except FileNotFoundError:  # removed by a concurrent prune
                pass

    def _dir(self, upload_id: str) -> Path:
        return Path(os.path.realpath(self._root)) / upload_id

    def status(self, upload_id: str) -> UploadStatus:
        d = self._dir(upload_id)
        files = {p.name: sha256_file(p) for p in sorted(d.iterdir()) if p.is_file() and not p.name.startswith(".")} \
            if d.is_dir() else {}
        return UploadStatus(source_uri=str(d), files=files)

    async def put(self, upload_id: str, filename: str, sha256: str, body: AsyncIterator[bytes]) -> UploadStatus:
        d = self._dir(upload_id)
        if not d.exists():
            self._root.mkdir(parents=True, exist_ok=True)
            self._prune()
        d.mkdir(parents=True, exist_ok=True)
        dest = d / filename
        if dest.is_file() and sha256_file(dest) == sha256:
            async for _ in body:  # drain, so the client's request completes normally
                pass
            return self.status(upload_id)
        present = [p for p in d.iterdir() if not p.name.startswith(".") and p.name != filename]
        if len(present) >= self._max_files:
            raise RegistryValidationError(f"too many files in upload {upload_id}: limit {self._max_files}",
                                          code="too_many_files")
        fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{filename}.")
        h, size = hashlib.sha256(), 0
        try:
            with os.fdopen(fd, "wb") as out:
                async for chunk in body:
                    size += len(chunk)
                    if size > self._max_file_bytes:
                        raise RegistryValidationError(f"file {filename} is oversize: more than "
                                                      f"{self._max_file_bytes} bytes", code="file_too_large")
                    h.update(chunk)
                    out.write(chunk)
            if h.hexdigest() != sha256:
                raise RegistryValidationError(f"sha256 mismatch for uploaded {filename}: declared {sha256}, "
                                              f"received {h.hexdigest()} ({size} bytes)", code="sha256_mismatch")
            os.replace(tmp, dest)
        finally:
            Path(tmp).unlink(missing_ok=True)
        return self.status(upload_id)
