"""MinIO / S3 through the `minio` SDK: the store's backend, one bucket under a key prefix.

It reaches the configured store endpoint with the store's credentials (`Connection`) and
retries transient errors with jittered backoff for at most `store.timeout_s` (`retry`), both
in connection.py; the s3:// sources tokenize reads are in sources.py.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from components.config import StoreConfig
from components.store.connection import Connection, retry
from components.store.keys import MANIFEST, StoreError, check_range

log = logging.getLogger(__name__)
T = TypeVar("T")


class MinioBackend:
    """The store in one bucket (under a key prefix), with bounded retries on transient errors.

    create=False: the bucket must exist (what reading commands need): else a StoreError
    `store.bucket=NAME: no artifact store there (...)`; otherwise it is made, versioning on.

    Conditional writes (leases) are PutObject with `If-None-Match: *` or `If-Match: <etag>`, which
    MinIO and S3 evaluate atomically. A server that checks the condition apart from the write
    (moto's, in the tests) can let two overlapping writers both succeed: `settle_s` is how long
    lease.py waits before reading its write back to see which of them the store kept."""

    settle_s = 0.5

    def __init__(self, conn: Connection, bucket: str, prefix: str, create: bool = True):
        self.endpoint, self.bucket, self.timeout_s = conn.endpoint, bucket, conn.timeout_s
        self.prefix = prefix.strip("/")
        self.description = f"MinIO endpoint {conn.endpoint} bucket {bucket}"
        self.client = conn.client()
        if create:
            self._retry(self._ensure_bucket, "prepare bucket")
        elif not self._retry(lambda: self.client.bucket_exists(bucket), "look up bucket"):
            raise StoreError(f"store.bucket={bucket}: no artifact store there (MinIO endpoint {conn.endpoint})")

    @classmethod
    def from_config(cls, cfg: StoreConfig, create: bool = True) -> MinioBackend:
        return cls(Connection.from_config(cfg), cfg.bucket, cfg.root, create)

    def _ensure_bucket(self) -> None:
        """Make the bucket, versioning on, only when it is missing: an existing bucket is a
        deploy step's (deploy/README.md), and a least-privilege user may neither create buckets
        nor read or set their versioning, so neither is ever asked of it."""
        from minio.commonconfig import ENABLED
        from minio.error import S3Error
        from minio.versioningconfig import VersioningConfig

        if self.client.bucket_exists(self.bucket):
            return
        try:
            self.client.make_bucket(self.bucket)
        except S3Error as e:
            if e.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise
            return  # another writer made it first, and turns versioning on
        try:
            self.client.set_bucket_versioning(self.bucket, VersioningConfig(ENABLED))
        except S3Error as e:  # a server without versioning (some SeaweedFS releases): say so, go on
            log.warning(
                "store %s: could not turn on versioning for new bucket %s: %s", self.endpoint, self.bucket, e.code
            )

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _retry(self, op: Callable[[], T], what: str) -> T:
        return retry(op, what, self.endpoint, self.description, self.timeout_s)

    def put_file(self, key: str, path: Path) -> None:
        self._retry(lambda: self.client.fput_object(self.bucket, self._key(key), str(path)), f"put {key}")

    def put_bytes(self, key: str, data: bytes) -> None:
        import io

        self._retry(
            lambda: self.client.put_object(self.bucket, self._key(key), io.BytesIO(data), len(data)), f"put {key}"
        )

    def _read(self, key: str, **byte_range) -> bytes:
        resp = self.client.get_object(self.bucket, self._key(key), **byte_range)
        try:
            return resp.read()
        finally:
            resp.close()
            resp.release_conn()

    def get_bytes(self, key: str) -> bytes:
        return self._retry(lambda: self._read(key), f"get {key}")

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """length bytes from offset, fewer at the end of the object (none past it)."""
        from minio.error import S3Error

        check_range(offset, length)
        if length == 0:  # minio reads `length=0` as "to the end"
            self._retry(lambda: self.client.stat_object(self.bucket, self._key(key)), f"stat {key}")
            return b""

        def op() -> bytes:
            try:
                return self._read(key, offset=offset, length=length)
            except S3Error as e:
                if e.code == "InvalidRange":  # offset at or past the end
                    return b""
                raise

        return self._retry(op, f"get {key} bytes {offset}+{length}")

    def get_file(self, key: str, dest: Path) -> None:
        self._retry(lambda: self.client.fget_object(self.bucket, self._key(key), str(dest)), f"get {key}")

    def list_prefixes(self, prefix: str) -> list[str]:
        full = self._key(prefix) + "/" if prefix else (self.prefix + "/" if self.prefix else "")

        def op() -> list[str]:
            names = []
            for obj in self.client.list_objects(self.bucket, prefix=full, recursive=False):
                if obj.is_dir:
                    names.append(obj.object_name[len(full) :].rstrip("/"))
            return sorted(names)

        return self._retry(op, f"list {prefix or '/'}")

    def list_manifests(self, prefix: str) -> dict[str, float]:
        full = self._key(prefix) + "/"

        def op() -> dict[str, float]:
            found = {}
            for obj in self.client.list_objects(self.bucket, prefix=full, recursive=True):
                version, _, rest = obj.object_name[len(full) :].partition("/")
                if rest == MANIFEST:
                    found[version] = obj.last_modified.timestamp()
            return found

        return self._retry(op, f"list {prefix}")

    def list_sizes(self, prefix: str) -> dict[str, int]:
        full = self._key(prefix) + "/"

        def op() -> dict[str, int]:
            objects = self.client.list_objects(self.bucket, prefix=full, recursive=True)
            return {obj.object_name[len(full) :]: obj.size for obj in objects}

        return self._retry(op, f"list {prefix}")

    def delete(self, key: str) -> None:
        self._retry(lambda: self.client.remove_object(self.bucket, self._key(key)), f"delete {key}")

    def _conditional_put(self, key: str, data: bytes, condition: dict) -> bool:
        """PutObject with a precondition header; False when the store refused it (412, or 409:
        another conditional write to the key was in flight)."""
        from minio.error import S3Error

        headers = {"Content-Type": "application/octet-stream", **condition}

        def op() -> bool:
            try:
                # the SDK's put_object turns unknown headers into x-amz-meta-*; PutObject itself does not
                self.client._put_object(self.bucket, self._key(key), data, headers)
                return True
            except S3Error as e:
                if e.code in ("PreconditionFailed", "ConditionalRequestConflict") or e.response.status in (409, 412):
                    return False
                raise

        return self._retry(op, f"conditional put {key}")

    def put_bytes_if_absent(self, key: str, data: bytes) -> bool:
        """Write key only when no object is there (`If-None-Match: *`); False when one is."""
        return self._conditional_put(key, data, {"If-None-Match": "*"})

    def _read_tagged(self, key: str) -> tuple[bytes, str] | None:
        """The object's bytes and ETag from one GET; None when there is none."""
        from minio.error import S3Error

        def op() -> tuple[bytes, str] | None:
            try:
                resp = self.client.get_object(self.bucket, self._key(key))
            except S3Error as e:
                if e.code == "NoSuchKey":
                    return None
                raise
            try:
                return resp.read(), resp.headers.get("etag", "")
            finally:
                resp.close()
                resp.release_conn()

        return self._retry(op, f"get {key}")

    def replace_bytes_if(self, key: str, expected: bytes, data: bytes) -> bool:
        """Write key only when it holds exactly `expected` now (`If-Match` the ETag of the bytes
        read); False when it holds anything else, nothing, or changed in between."""
        current = self._read_tagged(key)
        if current is None or current[0] != expected:
            return False
        return self.put_bytes_if_etag(key, data, current[1])

    def put_bytes_if_etag(self, key: str, data: bytes, etag: str) -> bool:
        """Write key only when its ETag is `etag` now (`If-Match`); False when it is not."""
        return self._conditional_put(key, data, {"If-Match": etag})

    def digest(self, key: str, chunk: int = 1 << 20) -> tuple[str, int]:
        """(sha256 hex, size) of an object, streamed: nothing is copied or kept. A transient
        error restarts the read."""

        def op() -> tuple[str, int]:
            h, size = hashlib.sha256(), 0
            resp = self.client.get_object(self.bucket, self._key(key))
            try:
                for block in resp.stream(chunk):
                    h.update(block)
                    size += len(block)
            finally:
                resp.close()
                resp.release_conn()
            return h.hexdigest(), size

        return self._retry(op, f"read {key}")

    def _object_versions(self, prefix: str, latest: bool | None = None) -> list[tuple[str, str | None]]:
        """(object name, version id) of every version and delete marker of the object `prefix`
        and of every object under `prefix/` (one listing); latest=False: only noncurrent ones."""
        full = self._key(prefix)

        def op() -> list[tuple[str, str | None]]:
            found = []
            for obj in self.client.list_objects(self.bucket, prefix=full, recursive=True, include_version=True):
                name = obj.object_name
                if name != full and not name.startswith(full + "/"):
                    continue  # `v1` must not match `v10`
                if latest is False and obj.is_latest == "true":
                    continue
                found.append((name, obj.version_id))
            return found

        return self._retry(op, f"list versions of {prefix}")

    def _remove_versions(self, versions: list[tuple[str, str | None]], what: str) -> int:
        for name, version_id in versions:
            self._retry(
                lambda n=name, v=version_id: self.client.remove_object(self.bucket, n, version_id=v),
                f"delete {what} ({name} version {version_id})",
            )
        return len(versions)

    def purge(self, prefix: str) -> int:
        """Remove the object `prefix` or everything under `prefix/`, every version of it and its
        delete markers (the bucket is versioned: a plain delete only hides an object); how many
        object versions went."""
        return self._remove_versions(self._object_versions(prefix), prefix)

    def drop_history(self, key: str) -> int:
        """Remove the noncurrent versions of one object (a lease rewritten on every heartbeat)."""
        older = [v for v in self._object_versions(key, latest=False) if v[0] == self._key(key)]
        return self._remove_versions(older, key)
