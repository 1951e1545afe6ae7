"""`liftoff run experiment=tiny-mix`: a two-source mixture through kfp.local (issue 44)."""

from __future__ import annotations

import json
import math

from components.config import compose
from components.store import Ref, open_store
from pipelines.cli import main
from tests.conftest import ROOT
from tests.helpers import TOY
from tests.pipeline.test_local_run import executed, in_tmp  # noqa: F401 (a fixture)

MIX = [
    "experiment=tiny-mix",
    f"data.sources.kjv.paths=[{ROOT / 'corpus' / 'kjv.jsonl'}]",
    f"data.sources.pystdlib.paths=[{ROOT / 'corpus' / 'pystdlib.jsonl'}]",
    *TOY[1:],  # TOY without its data.paths
    "train.log_interval=5",
]
VERSIONED = ("dataset", "shard", "tokenizer")


def newest_log(root) -> str:
    return max(root.rglob("run.log"), key=lambda p: p.stat().st_mtime).read_text()


def test_a_two_source_run_draws_by_weight_and_other_weights_tokenize_nothing(in_tmp):  # noqa: F811
    """Acceptance 1 and 2: the run's own records count the samples each source gave at two
    prefixes of the run, within the binomial tolerance of its weight; the model names both
    sources' versions and the weights. A second run that changes only the weights runs no shard
    task and publishes no dataset, shard or tokenizer version."""
    assert main(["run", *MIX]) == 0
    store = open_store(compose(MIX).store)
    (model,) = store.ls("model")
    corpus = store.manifest(Ref.parse(next(p for p in model.parents if p.startswith("dataset/"))))
    mixture = model.metadata["mixture"]
    assert {s: m["dataset"] for s, m in mixture.items()} == corpus.metadata["sources"]
    assert {s: m["weight"] for s, m in mixture.items()} == {"kjv": 0.7, "pystdlib": 0.3}
    (run,) = store.ls("run")
    records = [json.loads(line) for line in (store.fetch(run.ref) / "metrics.jsonl").read_text().splitlines()]
    drawn = {r["step"]: r["drawn"] for r in records if "drawn" in r and r.get("step") in (5, 10)}
    per_step = 8  # train.micro_batch_size on one process
    for step, counts in drawn.items():
        n = step * per_step
        assert sum(counts.values()) == n
        for s, w in (("kjv", 0.7), ("pystdlib", 0.3)):
            assert abs(counts[s] - w * n) <= 4 * math.sqrt(n * w * (1 - w)) + 1, (step, counts)
    assert sorted(drawn) == [5, 10] and mixture["kjv"]["drawn"] == drawn[10]["kjv"]
    before = {kind: sorted(str(m.ref) for m in store.ls(kind)) for kind in VERSIONED}
    assert main(["run", *MIX, "data.mixture.kjv=0.2", "data.mixture.pystdlib=0.8"]) == 0
    tasks = executed(newest_log(in_tmp / "runs"))
    assert "tokenize-shard" not in tasks and tasks.count("train") == 1  # the shard tasks: cache hits
    assert {kind: sorted(str(m.ref) for m in store.ls(kind)) for kind in VERSIONED} == before
    models = {m.metadata["mixture"]["pystdlib"]["weight"]: m for m in store.ls("model")}
    assert sorted(models) == [0.3, 0.8] and models[0.8].parents[0] == str(corpus.ref)
    assert models[0.8].metadata["identity"] != models[0.3].metadata["identity"]
