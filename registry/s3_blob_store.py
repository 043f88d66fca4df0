"""Content-addressed blobs in S3 (boto3): key `{prefix}/sha256/{digest}`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from botocore.exceptions import ClientError

from registry.blob_store import Progress, check_digest

__all__ = ["S3BlobStore", "make_s3_client"]


def make_s3_client(endpoint_url: str | None = None) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=endpoint_url)


class S3BlobStore:
    def __init__(self, client: Any, bucket: str, prefix: str = "blobs"):
        self._s3 = client
        self._bucket = bucket
        self._prefix = prefix.strip("/")
        self.location = f"s3://{bucket}/{self._prefix}"

    def _key(self, sha256: str) -> str:
        return f"{self._prefix}/sha256/{check_digest(sha256)}"

    def put(self, sha256: str, path: Path, progress: Progress | None = None) -> None:
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
        try:
            self._s3.download_file(self._bucket, self._key(sha256), str(dest))
        except ClientError as e:
            raise FileNotFoundError(f"blob {sha256} not in {self.location}: {e}") from e

    def exists(self, sha256: str) -> bool:
        return self.modified_at(sha256) is not None

    def modified_at(self, sha256: str) -> float | None:
        try:
            return self._s3.head_object(Bucket=self._bucket, Key=self._key(sha256))["LastModified"].timestamp()
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise

    def delete(self, sha256: str) -> None:
        self._s3.delete_object(Bucket=self._bucket, Key=self._key(sha256))

    def list(self) -> list[str]:
        out = []
        for page in self._s3.get_paginator("list_objects_v2").paginate(Bucket=self._bucket,
                                                                        Prefix=f"{self._prefix}/sha256/"):
            out += [o["Key"].rsplit("/", 1)[1] for o in page.get("Contents", [])]
        return sorted(out)
