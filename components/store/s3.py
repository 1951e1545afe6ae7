"""MinIO / S3 through the `minio` SDK: the store's backend, and the s3:// sources tokenize reads.

Both reach the configured store endpoint with the store's credentials (`Connection`) and
retry transient errors with jittered backoff for at most `store.timeout_s` (`retry`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from components.config import StoreBackend, StoreConfig
from components.store.keys import (
    MANIFEST,
    IntegrityError,
    InvalidKey,
    NotFound,
    StoreError,
    StoreUnreachable,
    check_range,
    check_relpath,
)

if TYPE_CHECKING:
    from minio import Minio

log = logging.getLogger(__name__)
T = TypeVar("T")
_TRANSIENT = ("SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def retry(op: Callable[[], T], what: str, endpoint: str, description: str, timeout_s: float) -> T:
    """op(), retried on transient errors for at most timeout_s in all; then StoreUnreachable naming
    the endpoint. A missing key or bucket is NotFound, any other S3 error a StoreError, at once."""
    import urllib3
    from minio.error import S3Error, ServerError

    start, attempt, delay = time.monotonic(), 0, 0.2
    while True:
        attempt += 1
        try:
            return op()
        except S3Error as e:
            if e.code in ("NoSuchKey", "NoSuchBucket"):
                raise NotFound(f"{what}: {e.code} at {description}") from None
            if e.code not in _TRANSIENT:
                raise StoreError(f"{what} failed at {description}: {e.code}: {e.message}") from None
            err: Exception = e
        except (ServerError, urllib3.exceptions.HTTPError, ConnectionError, TimeoutError) as e:
            err = e
        elapsed = time.monotonic() - start
        if elapsed + delay > timeout_s:
            raise StoreUnreachable(
                f"artifact store at {endpoint} unreachable: {what} failed {attempt} times in "
                f"{elapsed:.1f}s (store.timeout_s={timeout_s}); last error: {type(err).__name__}"
            ) from None
        log.warning("store %s: %s failed (%s), retry %d in %.1fs", endpoint, what, type(err).__name__, attempt, delay)
        time.sleep(delay * (0.5 + random.random()))
        delay = min(delay * 2, 5.0)


@dataclass(frozen=True)
class Connection:
    """Where the store's MinIO is and how to sign in; the keys come only from the environment."""

    endpoint: str
    secure: bool
    timeout_s: float
    access_key: str | None = field(default=None, repr=False)
    secret_key: str | None = field(default=None, repr=False)

    @classmethod
    def from_config(cls, cfg: StoreConfig) -> Connection:
        endpoint = cfg.endpoint or os.environ.get("MINIO_ENDPOINT")
        if not endpoint:
            raise StoreError("store.backend=minio needs store.endpoint or $MINIO_ENDPOINT")
        secure = (
            cfg.secure
            if cfg.secure is not None
            else os.environ.get("MINIO_SECURE", "false").lower() in ("1", "true", "yes")
        )
        return cls(
            endpoint, secure, cfg.timeout_s, os.environ.get("MINIO_ACCESS_KEY"), os.environ.get("MINIO_SECRET_KEY")
        )

    def client(self) -> Minio:
        import urllib3
        from minio import Minio

        # No retries inside urllib3: `retry` owns the schedule and its total time.
        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=min(5.0, self.timeout_s), read=60.0), retries=False, maxsize=32
        )
        return Minio(
            self.endpoint,
            access_key=self.access_key,
            secret_key=self.secret_key,
            secure=self.secure,
            http_client=http,
        )


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
        return self._conditional_put(key, data, {"If-Match": current[1]})

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


def parse_s3_url(url: str) -> tuple[str, str]:
    """`s3://BUCKET[/KEY-OR-PREFIX]` as (bucket, key-or-prefix)."""
    bucket, _, key = url.removeprefix("s3://").partition("/") if url.startswith("s3://") else ("", "", "")
    if not _BUCKET.match(bucket) or "\0" in key:
        raise InvalidKey(f"invalid S3 url {url!r}: expected s3://BUCKET[/PREFIX]")
    return bucket, key


@dataclass(frozen=True)
class SourceObject:
    """One object of an s3:// source: relpath is its key under the listed prefix (the basename
    when the url named the object itself); etag without quotes."""

    url: str
    bucket: str
    key: str
    relpath: str
    size: int
    etag: str


class ObjectSource:
    """Objects under s3:// urls at the store's endpoint, read with the store's credentials."""

    def __init__(self, conn: Connection):
        self.endpoint, self.timeout_s = conn.endpoint, conn.timeout_s
        self.description = f"MinIO endpoint {conn.endpoint}"
        self.client = conn.client()

    def _retry(self, op: Callable[[], T], what: str) -> T:
        return retry(op, what, self.endpoint, self.description, self.timeout_s)

    def list(self, url: str) -> list[SourceObject]:
        """The objects a url names, by key: the object itself when one is named exactly so, else
        every object under it as a folder (`s3://b/dir` lists `dir/...`). NotFound names the url
        when its bucket does not exist or nothing is under it."""
        bucket, key = parse_s3_url(url)
        if not self._retry(lambda: self.client.bucket_exists(bucket), f"look up bucket of {url}"):
            raise NotFound(f"{url}: bucket {bucket!r} does not exist at {self.description}")
        if key and not key.endswith("/") and (one := self._stat(bucket, key, url)):
            return [one]
        prefix = key if not key or key.endswith("/") else key + "/"

        def op() -> list:
            return list(self.client.list_objects(bucket, prefix=prefix or None, recursive=True))

        found = [
            self._object(url, bucket, o.object_name, o.object_name[len(prefix) :], o.size, o.etag)
            for o in self._retry(op, f"list {url}")
            if not o.object_name.endswith("/")  # folder markers some tools write
        ]
        if not found:
            raise NotFound(f"{url}: no objects under s3://{bucket}/{prefix} at {self.description}")
        return sorted(found, key=lambda o: o.key)

    def _stat(self, bucket: str, key: str, url: str) -> SourceObject | None:
        from minio.error import S3Error

        def op():
            try:
                return self.client.stat_object(bucket, key)
            except S3Error as e:
                if e.code == "NoSuchKey":
                    return None
                raise

        st = self._retry(op, f"look up {url}")
        return st and self._object(url, bucket, key, key.rsplit("/", 1)[-1], st.size, st.etag)

    @staticmethod
    def _object(url: str, bucket: str, key: str, relpath: str, size: int, etag: str) -> SourceObject:
        try:
            check_relpath(relpath)
        except InvalidKey:
            raise InvalidKey(f"{url}: object key {key!r} is no safe relative path ({relpath!r})") from None
        return SourceObject(f"s3://{bucket}/{key}", bucket, key, relpath, int(size), (etag or "").strip('"'))

    def download(self, obj: SourceObject, dest: Path) -> None:
        """Stream obj to `dest.<pid>.part`, check its size (and MD5 when the ETag is a single-part
        one) against the listing, then rename it to dest. IntegrityError names the url."""
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f"{dest.name}.{os.getpid()}.part")
        try:
            size, md5 = self._retry(lambda: self._stream(obj, tmp), f"download {obj.url}")
            if size != obj.size:
                raise IntegrityError(f"{obj.url}: downloaded {size} bytes, listed as {obj.size} at {self.description}")
            if "-" not in obj.etag and md5 != obj.etag.lower():
                raise IntegrityError(
                    f"{obj.url}: MD5 mismatch at {self.description}: ETag {obj.etag}, downloaded bytes {md5}"
                )
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)

    def _stream(self, obj: SourceObject, tmp: Path) -> tuple[int, str]:
        md5, size = hashlib.md5(usedforsecurity=False), 0
        resp = self.client.get_object(obj.bucket, obj.key)
        try:
            with open(tmp, "wb") as f:
                for block in resp.stream(1 << 20):
                    f.write(block)
                    md5.update(block)
                    size += len(block)
        finally:
            resp.close()
            resp.release_conn()
        return size, md5.hexdigest()


def object_source(cfg: StoreConfig) -> ObjectSource:
    """Reader of s3:// sources on the store's endpoint, with the store's credentials."""
    if cfg.backend != StoreBackend.minio:
        backend = getattr(cfg.backend, "value", cfg.backend)
        raise StoreError(
            f"s3:// sources need store.backend=minio (they are read from the store's endpoint with its "
            f"credentials); store.backend is {backend}"
        )
    return ObjectSource(Connection.from_config(cfg))
