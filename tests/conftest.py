"""Shared fixtures: a real S3 endpoint on loopback (moto's server) and both store backends."""

from __future__ import annotations

import socket
import uuid
from pathlib import Path

import pytest

from components.config import StoreBackend, StoreConfig
from components.store import open_store

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "corpus" / "kjv.jsonl"
S3_ACCESS_KEY = "liftoff-test-access-SENTINEL-7f3a"
S3_SECRET_KEY = "liftoff-test-secret-SENTINEL-91c2"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint() -> str:
    """moto's S3 server over real HTTP on 127.0.0.1; never skipped."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3_env(s3_endpoint, monkeypatch) -> str:
    monkeypatch.setenv("MINIO_ENDPOINT", s3_endpoint)
    monkeypatch.setenv("MINIO_ACCESS_KEY", S3_ACCESS_KEY)
    monkeypatch.setenv("MINIO_SECRET_KEY", S3_SECRET_KEY)
    monkeypatch.setenv("MINIO_SECURE", "false")
    return s3_endpoint


def store_config(backend: str, tmp_path: Path, **kw) -> StoreConfig:
    if backend == "local":
        return StoreConfig(
            backend=StoreBackend.local, root=str(tmp_path / "store"), cache_dir=str(tmp_path / "cache"), **kw
        )
    return StoreConfig(
        backend=StoreBackend.minio,
        bucket=f"t-{uuid.uuid4().hex[:12]}",
        root="",
        cache_dir=str(tmp_path / "cache"),
        timeout_s=kw.pop("timeout_s", 10.0),
        **kw,
    )


@pytest.fixture(params=["local", "minio"])
def store_cfg(request, tmp_path) -> StoreConfig:
    if request.param == "minio":
        request.getfixturevalue("s3_env")
    return store_config(request.param, tmp_path)


@pytest.fixture
def store(store_cfg):
    return open_store(store_cfg)
