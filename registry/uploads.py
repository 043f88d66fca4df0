"""The control plane's upload area: a remote `lora-registry push` streams each file into
`{upload_dir}/{upload_id}/`, which is an allowed source root, then registers that directory like any other.

An upload is a session: the client derives `upload_id` from the files' hashes, so a retried push lands in the same
directory, and the session lives until `ttl_s` after its last file arrived. A file streams to disk (never held in
memory) under a partial name, hashed as it arrives and capped at `max_file_bytes`; a push that was cut off resumes
where the partial file ends (`offset`, from `status`), the hash carried over by reading the part already there.
The file is renamed into place only when its sha256 matches, so a directory never shows a partial or wrong file.

A refused file leaves nothing of itself (a file over the limit, a wrong hash) and the session's other files stay.
A refused registration of an upload leaves the session as it is, so the corrected registration (the right
sha256, say) reuses the files; a registration that succeeds ends it (the files are in the blob store by then).
Sessions past their time to live are removed when a new one starts. The whole area holds at most
`max_area_bytes`: a file that would take it past that is refused (507) until sessions end; `usage()` reports it.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import time
from pathlib import Path
from typing import AsyncIterator, Optional

from pydantic import BaseModel, Field

from registry.errors import LifecycleConflict, RegistryValidationError
from registry.validation import sha256_file

__all__ = ["UploadArea", "UploadStatus", "UploadTooLarge", "UploadAreaFull", "UploadAreaUsage"]

_CHUNK = 1 << 20


class UploadTooLarge(RegistryValidationError):
    status = 413


class UploadAreaFull(RegistryValidationError):
    status = 507


class UploadStatus(BaseModel):
    source_uri: str = Field(description="register with this source_uri once every file is uploaded")
    expires_at: float = Field(0.0, description="when the session ends unless another file arrives (unix seconds)")
    files: dict[str, str] = Field(description="file name -> sha256 of the files uploaded so far")
    partial: dict[str, dict[str, int]] = Field(default_factory=dict, description=(
        "file name -> {first 16 hex digits of its sha256: bytes received} of files still incomplete: resume one "
        "with X-Upload-Offset"))


class UploadSession(BaseModel):
    upload_id: str
    bytes: int = Field(description="bytes on disk, partial files included")
    files: int
    expires_at: float


class UploadAreaUsage(BaseModel):
    bytes: int = Field(description="bytes on disk in every session")
    max_bytes: int = Field(description="the area's bound (RegistrySettings.max_upload_area_bytes)")
    ttl_s: float = Field(description="a session ends this long after its last file arrived")
    sessions: list[UploadSession]


def _dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.iterdir() if p.is_file())


def _hash_prefix(path: Path, h) -> None:
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)


class UploadArea:
    ID_PATTERN = r"^[A-Za-z0-9_-]{8,64}$"
    FILE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"

    def __init__(self, root: Path, max_files: int, max_file_bytes: int, ttl_s: float = 86400.0,
                 max_area_bytes: int = 8 << 30):
        self.root = Path(root)
        self.max_file_bytes = max_file_bytes
        self.max_area_bytes = max_area_bytes
        self._max_files = max_files
        self._ttl_s = ttl_s

    def _sessions(self) -> list[Path]:
        return sorted(d for d in self.root.iterdir() if d.is_dir()) if self.root.is_dir() else []

    def usage(self) -> UploadAreaUsage:
        """What the area holds now, session by session."""
        sessions = []
        for d in self._sessions():
            try:
                sessions.append(UploadSession(upload_id=d.name, bytes=_dir_bytes(d), expires_at=self._expires(d),
                                              files=sum(1 for p in d.iterdir() if not p.name.startswith("."))))
            except FileNotFoundError:  # ended meanwhile
                continue
        return UploadAreaUsage(bytes=sum(s.bytes for s in sessions), max_bytes=self.max_area_bytes,
                               ttl_s=self._ttl_s, sessions=sessions)

    def _expires(self, d: Path) -> float:
        return d.stat().st_mtime + self._ttl_s

    def _room(self, upload_id: str, filename: str) -> int:
        """Bytes this file may still take before the area is full (a 507 when none)."""
        room = self.max_area_bytes - self.usage().bytes
        if room <= 0:
            raise UploadAreaFull(f"the upload area is full ({self.max_area_bytes} bytes): {filename} of upload "
                                 f"{upload_id} can go once other uploads are registered or expire (GET "
                                 f"/v1/uploads lists them)", code="upload_area_full")
        return room

    def _prune(self) -> None:
        cutoff = time.time() - self._ttl_s
        for d in self.root.iterdir():
            try:
                if d.is_dir() and d.stat().st_mtime < cutoff:
                    shutil.rmtree(d, ignore_errors=True)
            except FileNotFoundError:  # removed by a concurrent prune
                pass

    def _dir(self, upload_id: str) -> Path:
        return Path(os.path.realpath(self.root)) / upload_id

    @staticmethod
    def _partial(d: Path, filename: str, sha256: str) -> Path:
        return d / f".{filename}.{sha256[:16]}.part"

    def status(self, upload_id: str) -> UploadStatus:
        d = self._dir(upload_id)
        files, partial = {}, {}
        for p in sorted(d.iterdir()) if d.is_dir() else ():
            if p.is_file() and not p.name.startswith("."):
                files[p.name] = sha256_file(p)
            elif p.is_file() and p.name.endswith(".part"):
                name, digest, _ = p.name[1:].rsplit(".", 2)
                partial.setdefault(name, {})[digest] = p.stat().st_size
        expires = self._expires(d) if d.is_dir() else 0.0
        return UploadStatus(source_uri=str(d), files=files, partial=partial, expires_at=expires)

    def discard(self, upload_id: str) -> None:
        shutil.rmtree(self._dir(upload_id), ignore_errors=True)

    def discard_source(self, source_uri: object) -> None:
        """End the upload session `source_uri` names, if it is one (a registration of it succeeded)."""
        if isinstance(source_uri, str) and source_uri:
            path = Path(os.path.realpath(source_uri))
            if path.parent == Path(os.path.realpath(self.root)) and path.is_dir():
                shutil.rmtree(path, ignore_errors=True)

    def _refuse(self, upload_id: str, part: Optional[Path], err: RegistryValidationError) -> RegistryValidationError:
        """`err`, the refused file's partial copy (if any) removed first, and the session if that was all it held."""
        if part is not None:
            part.unlink(missing_ok=True)
        try:
            self._dir(upload_id).rmdir()  # only when empty
        except OSError:
            pass
        return err

    async def put(self, upload_id: str, filename: str, sha256: str, body: AsyncIterator[bytes], offset: int = 0,
                  length: Optional[int] = None) -> UploadStatus:
        """Stream one file (from byte `offset` of it on, `length` bytes when the client declared them)."""
        d = self._dir(upload_id)
        if length is not None and offset + length > self.max_file_bytes:
            raise self._refuse(upload_id, None, UploadTooLarge(
                f"file {filename} is oversize: {offset + length} bytes, more than the upload limit of "
                f"{self.max_file_bytes} bytes", code="file_too_large"))
        if not d.exists():
            self.root.mkdir(parents=True, exist_ok=True)
            self._prune()
        d.mkdir(parents=True, exist_ok=True)
        dest = d / filename
        if dest.is_file() and sha256_file(dest) == sha256:
            async for _ in body:  # drain, so the client's request completes normally
                pass
            return self.status(upload_id)
        present = [p for p in d.iterdir() if not p.name.startswith(".") and p.name != filename]
        if len(present) >= self._max_files:
            raise self._refuse(upload_id, None, RegistryValidationError(
                f"too many files in upload {upload_id}: limit {self._max_files}", code="too_many_files"))
        partial = self._partial(d, filename, sha256)
        room = self._room(upload_id, filename)
        if length is not None and length > room:
            raise self._refuse(upload_id, None, UploadAreaFull(
                f"file {filename} ({length} bytes) does not fit in the upload area: {room} of its "
                f"{self.max_area_bytes} bytes are free", code="upload_area_full"))
        with partial.open("ab") as out:
            try:
                fcntl.flock(out, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise LifecycleConflict(f"file {filename} of upload {upload_id} is being uploaded by another "
                                        f"request", code="upload_in_progress") from None
            have = out.tell()
            if offset != have:
                raise LifecycleConflict(f"upload {upload_id} holds {have} bytes of {filename}; resume from "
                                        f"X-Upload-Offset: {have}", code="upload_offset_mismatch")
            h, size = hashlib.sha256(), have
            if have:
                _hash_prefix(partial, h)
            async for chunk in body:  # a client that goes away leaves the part received so far, to resume
                size += len(chunk)
                if size > self.max_file_bytes:
                    raise self._refuse(upload_id, partial, UploadTooLarge(
                        f"file {filename} is oversize: more than the upload limit of {self.max_file_bytes} bytes",
                        code="file_too_large"))
                if size - have > room:
                    raise self._refuse(upload_id, partial, UploadAreaFull(
                        f"file {filename} does not fit in the upload area: {room} of its {self.max_area_bytes} "
                        f"bytes were free", code="upload_area_full"))
                h.update(chunk)
                out.write(chunk)
            out.flush()
            if h.hexdigest() != sha256:
                raise self._refuse(upload_id, partial, RegistryValidationError(
                    f"sha256 mismatch for uploaded {filename}: declared {sha256}, received {h.hexdigest()} "
                    f"({size} bytes)", code="sha256_mismatch"))
            os.replace(partial, dest)
        os.utime(d)  # the session lives ttl_s from its last file
        return self.status(upload_id)
