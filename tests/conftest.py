"""Shared fixtures: a real S3 endpoint on loopback (moto's server) and both store backends."""

from __future__ import annotations

import shutil
import socket
import threading
import uuid
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from components.config import StoreBackend, StoreConfig, compose, defaults
from components.store import open_store
from components.tokenize.stage import run_tokenize

# the asserts in tests/helpers.py report their operands on failure, as a test module's do
pytest.register_assert_rewrite("tests.helpers")

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "corpus" / "kjv.jsonl"
S3_ACCESS_KEY = "liftoff-test-access-SENTINEL-7f3a"
S3_SECRET_KEY = "liftoff-test-secret-SENTINEL-91c2"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Traffic:
    """The body bytes the test S3 server sent, per request path: counted in the server between
    its WSGI app and the socket, so a test sees what a client really downloaded."""

    def __init__(self, app):
        self.app, self.sent, self.lock = app, {}, threading.Lock()

    def __call__(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        for chunk in self.app(environ, start_response):
            if environ.get("REQUEST_METHOD") == "GET":
                with self.lock:
                    self.sent[path] = self.sent.get(path, 0) + len(chunk)
            yield chunk

    def under(self, prefix: str) -> dict[str, int]:
        """Bytes sent per object key under `prefix` ("bucket/key/..."), since the server started."""
        with self.lock:
            return {p.lstrip("/"): n for p, n in self.sent.items() if p.lstrip("/").startswith(prefix)}


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server over real HTTP on 127.0.0.1 (never skipped), counting what it sends."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # the test server's access log is noise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    traffic = S3Traffic(server._server.app)
    server._server.app = traffic  # werkzeug's handler calls the server's app for every request
    yield f"127.0.0.1:{port}", traffic
    server.stop()


@pytest.fixture(scope="session")
def s3_endpoint(s3_server) -> str:
    return s3_server[0]


@pytest.fixture(scope="session")
def s3_traffic(s3_server) -> S3Traffic:
    return s3_server[1]


@pytest.fixture
def s3_env(s3_endpoint, monkeypatch) -> str:
    monkeypatch.setenv("MINIO_ENDPOINT", s3_endpoint)
    monkeypatch.setenv("MINIO_ACCESS_KEY", S3_ACCESS_KEY)
    monkeypatch.setenv("MINIO_SECRET_KEY", S3_SECRET_KEY)
    monkeypatch.setenv("MINIO_SECURE", "false")
    return s3_endpoint


def store_config(backend: str, tmp_path: Path, **kw) -> StoreConfig:
    if backend == "local":
        return defaults(
            "store", backend=StoreBackend.local, root=str(tmp_path / "store"), cache_dir=str(tmp_path / "cache"), **kw
        )
    return defaults(
        "store",
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


def split_corpus(dest: Path, parts: int = 8) -> Path:
    """The shipped corpus as `parts` JSONL files (documents dealt round-robin): a multi-file source."""
    dest.mkdir(parents=True, exist_ok=True)
    lines = CORPUS.read_text().splitlines()
    for i in range(parts):
        (dest / f"part-{i:02d}.jsonl").write_text("\n".join(lines[i::parts]) + "\n")
    return dest


def upload_corpus(store_cfg: StoreConfig, bucket: str, corpus: Path, prefix: str) -> str:
    """The corpus folder's files as objects under s3://bucket/prefix on the store's endpoint."""
    from components.store.connection import Connection

    client = Connection.from_config(store_cfg).client()
    client.make_bucket(bucket)
    for p in sorted(corpus.iterdir()):
        client.fput_object(bucket, f"{prefix}/{p.name}", str(p))
    return f"s3://{bucket}/{prefix}"


TRAIN_SHARDS = 4  # the dataset every training test reads: the shipped corpus in 4 shards


@pytest.fixture(scope="session")
def dataset_store(tmp_path_factory) -> Path:
    """A store holding the tokenized shipped corpus, split into 8 files and TRAIN_SHARDS shards (so
    every training test streams shards); tests copy it so runs never share checkpoints."""
    root = tmp_path_factory.mktemp("dataset-store")
    corpus = split_corpus(root / "corpus")
    cfg = OmegaConf.to_object(compose([f"data.paths=[{corpus}]", f"data.shards={TRAIN_SHARDS}"]))
    run_tokenize(
        cfg.data,
        cfg.tokenizer,
        cfg.model,
        open_store(defaults("store", root=str(root / "store"), cache_dir=str(root / "cache"))),
    )
    return root


class Trainer:
    def __init__(self, dataset_store: Path, tmp: Path):
        self.tmp, self.dataset_store = tmp, dataset_store
        shutil.copytree(dataset_store / "store", tmp / "store")
        self.store_cfg = defaults("store", root=str(tmp / "store"), cache_dir=str(tmp / "cache"))
        self.store = open_store(self.store_cfg)
        self.dataset = str(next(iter(self.store.ls("dataset"))).ref)

    # One fp32 process: fast runs for the tests of everything but precision and distribution;
    # the tests of the shipped 2-node fp8 default name those settings themselves.
    FAST = ("cluster.nodes=1", "train.precision=fp32", "train.activation_checkpointing=off")

    def config(self, *overrides: str):
        base = [f"data.paths=[{CORPUS}]", f"train.run_dir={self.tmp / 'runs'}", "train.log_interval=1", *self.FAST]
        return OmegaConf.to_object(compose([*base, *overrides]))

    def run(self, *overrides: str, **kw):
        from components.train.stage import run_train

        cfg = self.config(*overrides)
        result = run_train(
            self.dataset,
            cfg.model,
            cfg.train,
            cfg.cluster,
            self.store_cfg,
            self.store,
            cache_gb=cfg.data.cache_gb,
            **kw,
        )
        result.export = self.store.fetch(result.model)  # the model as the store hands it back
        return result


@pytest.fixture
def trainer(dataset_store, tmp_path) -> Trainer:
    return Trainer(dataset_store, tmp_path)


@pytest.fixture(scope="session")
def one_process(dataset_store, tmp_path_factory):
    """Trained once for the session: the HSDP, TP and PP tests compare their layouts with it."""
    from tests.helpers import LAYOUT

    return Trainer(dataset_store, tmp_path_factory.mktemp("one-process")).run(
        *LAYOUT, "train.steps=10", "train.micro_batch_size=8"
    )
