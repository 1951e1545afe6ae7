"""The tokenize stage: plan, one task per shard, merge. `run_tokenize` runs the three in one
process (tests, benchmarks); the pipeline runs them as KFP tasks (`dsl.ParallelFor`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from components.blocks import SPLITS
from components.config import DataConfig, ModelConfig, TokenizerConfig
from components.store import ArtifactStore, Manifest
from components.tokenize.merge import merge_shards
from components.tokenize.plan import make_plan
from components.tokenize.shard import run_shard

log = logging.getLogger(__name__)


@dataclass
class TokenizeResult:
    manifest: Manifest
    reused: bool

    @property
    def stats(self) -> dict:
        return self.manifest.metadata["stats"]


def run_tokenize(data: DataConfig, tok: TokenizerConfig, model: ModelConfig, store: ArtifactStore) -> TokenizeResult:
    plan, stored = make_plan(data, tok, model, store)
    if stored:
        return TokenizeResult(store.manifest(plan.dataset), reused=True)
    log.info("tokenizing into dataset %s: %d shard(s)", plan.dataset, plan.shards)
    refs = [str(run_shard(plan, i, data, store)[0].ref) for i in range(plan.shards)]
    manifest, _ = merge_shards(plan, refs, data, tok, store)
    log.info("dataset %s: %s", plan.dataset, {s: manifest.metadata["stats"]["splits"][s]["blocks"] for s in SPLITS})
    return TokenizeResult(manifest, reused=False)
