"""Reaching the store's MinIO / S3 endpoint: where it is and how to sign in (`Connection`).

The backend (s3.py) and the s3:// sources tokenize reads (sources.py) both reach the configured
store endpoint with the store's credentials and retry transient errors with jittered backoff for
at most `store.timeout_s` (`retry`).
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from components.config import StoreConfig
from components.store.keys import NotFound, StoreError, StoreUnreachable

if TYPE_CHECKING:
    from minio import Minio

log = logging.getLogger(__name__)
T = TypeVar("T")
_TRANSIENT = ("SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout")


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
