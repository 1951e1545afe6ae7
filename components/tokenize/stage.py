"""The tokenize stage: plan, one task per shard, merge. `run_tokenize` runs the three in one
process (tests, benchmarks); the pipeline runs them as KFP tasks (`dsl.ParallelFor`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from components.blocks import SPLITS
from components.config import DataConfig, ModelConfig, TokenizerConfig
from components.store import ArtifactStore, Manifest
from components.tokenize.merge import merge_all
from components.tokenize.plan import make_plans
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
    plans, stored = make_plans(data, tok, model, store)
    if stored and not data.sources:
        return TokenizeResult(store.manifest(plans[0].dataset), reused=True)
    refs = []
    for plan in plans:
        if not stored:
            log.info("tokenizing into dataset %s: %d shard(s)", plan.dataset, plan.shards)
        refs += [str(run_shard(plan, i, data.source(plan.dataset.name), store)[0].ref) for i in range(plan.shards)]
    manifest, reused = merge_all(plans, refs, data, tok, store)
    if stored:
        return TokenizeResult(manifest, reused=reused)
    log.info("dataset %s: %s", manifest.ref, {s: manifest.metadata["stats"]["splits"][s]["blocks"] for s in SPLITS})
    return TokenizeResult(manifest, reused=False)
