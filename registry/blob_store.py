"""The blob-store interface and its embedded implementation: content-addressed files in a local directory.

Blobs are keyed by their sha256, so a put is idempotent, two adapters sharing a file store it once, and a
reader re-hashes what it got to detect corruption in transit or at rest.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Protocol

__all__ = ["BlobStore", "LocalBlobStore", "check_digest"]

Progress = Callable[[int], None]  # called with the number of bytes just transferred
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")


def check_digest(sha256: str) -> str:
    # Digests become paths and object keys; anything but 64 hex digits is refused outright.
    if not _SHA_RE.match(sha256):
        raise ValueError(f"not a sha256 hex digest: {sha256!r}")
    return sha256


class BlobStore(Protocol):
    location: str  # human-readable root, recorded in each AdapterRecord.blob_location

    def put(self, sha256: str, path: Path, progress: Progress | None = None) -> None:
        """Store the file at `path` under `sha256` (caller has verified it); no-op if already present."""
        ...

    def get(self, sha256: str, dest: Path) -> None: ...

    def exists(self, sha256: str) -> bool: ...

    def list(self) -> list[str]: ...

    def modified_at(self, sha256: str) -> float | None:
        """When the blob was last written or re-put (epoch seconds); None if absent."""
        ...

    def delete(self, sha256: str) -> None: ...

    def ping(self) -> None:
        """Raise RegistryUnavailable unless the store can be reached."""
        ...


class LocalBlobStore:
    def __init__(self, root: str | Path):
        self._root = Path(root).resolve()
        self._root.mkdir(parents=True, exist_ok=True)
        self.location = str(self._root)

    def _path(self, sha256: str) -> Path:
        d = check_digest(sha256)
        return self._root / "sha256" / d[:2] / d

    def put(self, sha256: str, path: Path, progress: Progress | None = None) -> None:
        dst = self._path(sha256)
        if dst.exists():
            os.utime(dst)  # a re-put marks the blob as wanted again (garbage collection's grace period)
            if progress:
                progress(path.stat().st_size)
            return
        dst.parent.mkdir(parents=True, exist_ok=True)
        # Write to a temp name and rename: readers never see a partial blob, concurrent puts are harmless.
        fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as out, path.open("rb") as src:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
                    if progress:
                        progress(len(chunk))
            os.replace(tmp, dst)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def get(self, sha256: str, dest: Path) -> None:
        src = self._path(sha256)
        if not src.exists():
            raise FileNotFoundError(f"blob {sha256} not in {self.location}")
        shutil.copyfile(src, dest)

    def exists(self, sha256: str) -> bool:
        return self._path(sha256).exists()

    def modified_at(self, sha256: str) -> float | None:
        try:
            return self._path(sha256).stat().st_mtime
        except FileNotFoundError:
            return None

    def delete(self, sha256: str) -> None:
        self._path(sha256).unlink(missing_ok=True)

    def ping(self) -> None:
        return None  # a local directory is always there

    def list(self) -> list[str]:
        base = self._root / "sha256"
        return sorted(p.name for p in base.glob("*/*") if _SHA_RE.match(p.name)) if base.exists() else []
