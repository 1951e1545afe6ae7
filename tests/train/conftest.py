"""A tokenized shipped corpus and a helper that trains on it through the real launcher."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from components.config import StoreConfig, compose
from components.store import open_store
from components.tokenize.stage import run_tokenize
from tests.conftest import CORPUS


@pytest.fixture(scope="session")
def dataset_store(tmp_path_factory) -> Path:
    """A store holding the tokenized shipped corpus; tests copy it so runs never share checkpoints."""
    root = tmp_path_factory.mktemp("dataset-store")
    cfg = OmegaConf.to_object(compose([f"data.paths=[{CORPUS}]"]))
    run_tokenize(cfg.data, cfg.tokenizer, cfg.model, open_store(StoreConfig(root=str(root / "store"),
                                                                            cache_dir=str(root / "cache"))))
    return root


class Trainer:
    def __init__(self, dataset_store: Path, tmp: Path):
        self.tmp = tmp
        shutil.copytree(dataset_store / "store", tmp / "store")
        self.store_cfg = StoreConfig(root=str(tmp / "store"), cache_dir=str(tmp / "cache"))
        self.store = open_store(self.store_cfg)
        self.dataset = str(next(iter(self.store.ls("dataset"))).ref)

    def config(self, *overrides: str):
        base = [f"data.paths=[{CORPUS}]", f"train.run_dir={self.tmp / 'runs'}", "train.log_interval=1"]
        return OmegaConf.to_object(compose([*base, *overrides]))

    def run(self, *overrides: str):
        from components.train.stage import run_train

        cfg = self.config(*overrides)
        return run_train(self.dataset, cfg.model, cfg.train, cfg.cluster, self.store_cfg, self.store)


@pytest.fixture
def trainer(dataset_store, tmp_path) -> Trainer:
    return Trainer(dataset_store, tmp_path)
