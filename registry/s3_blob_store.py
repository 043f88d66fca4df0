"""Content-addressed blobs in S3 (boto3): key `{prefix}/sha256/{digest}`.

An endpoint that cannot be reached (refused, reset, timed out, or answering 5xx) is `RegistryUnavailable`,
so callers answer 503 and retry; the client's timeouts and retries are bounded so that takes seconds.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

from botocore.exceptions import ClientError, ConnectionError as BotoConnectionError, HTTPClientError

from registry.blob_store import Progress, check_digest
from registry.errors import RegistryUnavailable

__all__ = ["S3BlobStore", "make_s3_client", "s3_reachable"]


def make_s3_client(endpoint_url: str | None = None, connect_timeout_s: float = 2.0) -> Any:
    import boto3
    from botocore.config import Config

    # Two attempts, short connects: an outage shows in seconds instead of after botocore's default backoff.
    config = Config(connect_timeout=connect_timeout_s, read_timeout=60, retries={"max_attempts": 2, "mode": "standard"})
    return boto3.client("s3", endpoint_url=endpoint_url, config=config)


@contextlib.contextmanager
def s3_reachable() -> Iterator[None]:
    """Raise RegistryUnavailable("blobs") for an S3 endpoint out of reach; its other refusals pass through."""
    try:
        yield
    except (BotoConnectionError, HTTPClientError) as e:
        raise RegistryUnavailable("blobs", e) from e
    except ClientError as e:
        if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) >= 500:
            raise RegistryUnavailable("blobs", e) from e
        raise


class S3BlobStore:
    def __init__(self, client: Any, bucket: str, prefix: str = "blobs"):
        self._s3 = client
        self._bucket = bucket
        self._prefix = prefix.strip("/")
        self.location = f"s3://{bucket}/{self._prefix}"

    def _key(self, sha256: str) -> str:
        return f"{self._prefix}/sha256/{check_digest(sha256)}"

    def put(self, sha256: str, path: Path, progress: Progress | None = None) -> None:
        with s3_reachable():
            if self.exists(sha256):
                # Copying the object onto itself refreshes LastModified: a re-put marks the blob as wanted again.
                key = self._key(sha256)
                self._s3.copy_object(Bucket=self._bucket, Key=key, CopySource={"Bucket": self._bucket, "Key": key},
                                     MetadataDirective="REPLACE")
                if progress:
                    progress(path.stat().st_size)
                return
            # upload_file does multipart for large files; the object only appears once complete.
            self._s3.upload_file(str(path), self._bucket, self._key(sha256), Callback=progress)

    def get(self, sha256: str, dest: Path) -> None:
        with s3_reachable():
            try:
                self._s3.download_file(self._bucket, self._key(sha256), str(dest))
            except ClientError as e:
                if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) >= 500:
                    raise
                raise FileNotFoundError(f"blob {sha256} not in {self.location}: {e}") from e

    def exists(self, sha256: str) -> bool:
        return self.modified_at(sha256) is not None

    def modified_at(self, sha256: str) -> float | None:
        with s3_reachable():
            try:
                return self._s3.head_object(Bucket=self._bucket, Key=self._key(sha256))["LastModified"].timestamp()
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                    return None
                raise

    def delete(self, sha256: str) -> None:
        with s3_reachable():
            self._s3.delete_object(Bucket=self._bucket, Key=self._key(sha256))

    def list(self) -> list[str]:
        out = []
        with s3_reachable():
            for page in self._s3.get_paginator("list_objects_v2").paginate(Bucket=self._bucket,
                                                                            Prefix=f"{self._prefix}/sha256/"):
                out += [o["Key"].rsplit("/", 1)[1] for o in page.get("Contents", [])]
        return sorted(out)

    def ping(self) -> None:
        """Raise RegistryUnavailable unless the bucket answers."""
        with s3_reachable():
            self._s3.head_bucket(Bucket=self._bucket)
