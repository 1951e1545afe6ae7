"""The s3:// sources tokenize reads: objects under s3:// urls at the store's endpoint.

They are listed and downloaded (size and single-part MD5 checked) with the store's credentials
(`Connection`), transient errors retried for at most `store.timeout_s` (`retry`), as the backend does.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from components.config import StoreBackend, StoreConfig
from components.store.connection import Connection, retry
from components.store.keys import IntegrityError, InvalidKey, NotFound, StoreError, check_relpath

T = TypeVar("T")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


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
