"""`liftoff run experiment=tiny-mix`: a two-source mixture through kfp.local (issue 44)."""

from __future__ import annotations

import json
import math
import re

import pytest

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


def val_by_hand(store, model_dir, source_ref: str, n_blocks: int) -> tuple[float, float]:
    """Acceptance 4's second computation: the source's first val blocks read from its shard's
    Arrow file with pyarrow, the model loaded by transformers, the loss by torch, summed here."""
    import pyarrow as pa
    import torch
    from transformers import AutoModelForCausalLM

    rows = []
    for shard in store.manifest(Ref.parse(source_ref)).metadata["shards"]:
        path = store.fetch(Ref.parse(shard["ref"])) / "val.arrow"
        rows += pa.ipc.open_stream(pa.memory_map(str(path))).read_all().column("input_ids").to_pylist()
    ids = torch.tensor(rows[:n_blocks], dtype=torch.int64)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    with torch.no_grad():
        logits = model(input_ids=ids[:, :-1]).logits.float()
    loss = float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()))
    # bytes per target token from tokenizer.json itself: a byte-level BPE token's string has one
    # character per byte; added (special) tokens stand for no text
    spec = json.loads((store.fetch(Ref.parse(source_ref)) / "tokenizer" / "tokenizer.json").read_text())
    length = {i: len(s) for s, i in spec["model"]["vocab"].items()}
    length.update({t["id"]: 0 for t in spec["added_tokens"]})
    nbytes = sum(length[t] for t in ids[:, 1:].flatten().tolist())
    return loss, loss * ids[:, 1:].numel() / math.log(2) / nbytes


def val_loss_by_hand(store, model_dir, source_ref: str, n_blocks: int) -> float:
    return val_by_hand(store, model_dir, source_ref, n_blocks)[0]


def check_per_source_eval(store, model, corpus) -> None:
    """The eval artifact's per-source val losses equal a direct computation on each source's val
    split, and the mixture's is their weighed sum by the model's weights."""
    (evaluated,) = [e for e in store.ls("eval") if str(model.ref) in e.parents]
    metrics, n = evaluated.metadata["metrics"], compose(MIX).eval.val_blocks
    model_dir = store.fetch(model.ref)
    both = {s: val_by_hand(store, model_dir, ref, n) for s, ref in corpus.metadata["sources"].items()}
    by_hand = {s: loss for s, (loss, _) in both.items()}
    for s, (loss, bpb) in both.items():
        assert math.isclose(metrics[f"val_loss/{s}"], loss, rel_tol=1e-4), (s, metrics[f"val_loss/{s}"], loss)
        assert math.isclose(metrics[f"val_bits_per_byte/{s}"], bpb, rel_tol=1e-4), (s, bpb)
        assert math.isclose(metrics[f"val_perplexity/{s}"], math.exp(loss), rel_tol=1e-4)
    w = {"kjv": 0.7, "pystdlib": 0.3}
    assert math.isclose(metrics["val_loss"], sum(w[s] * by_hand[s] for s in w), rel_tol=1e-4)
    bytes_per_token = {s: loss / math.log(2) / bpb for s, (loss, bpb) in both.items()}  # each source's text
    mixed_bpb = sum(w[s] * by_hand[s] for s in w) / math.log(2) / sum(w[s] * bytes_per_token[s] for s in w)
    assert math.isclose(metrics["val_bits_per_byte"], mixed_bpb, rel_tol=1e-4)
    assert by_hand["kjv"] != by_hand["pystdlib"] and bytes_per_token["kjv"] != bytes_per_token["pystdlib"]


def check_per_source_val_in_training(store, model, corpus, records: list[dict]) -> None:
    """Training's periodic validation per source: the record's `val_loss/<source>` is the final
    model's loss on that source's first val blocks, computed by hand; TensorBoard has its curve."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from components.train.worker import VAL_BLOCKS

    (val,) = [r for r in records if r.get("kind") == "val" and r["step"] == 10]  # the last step validates
    model_dir = store.fetch(model.ref)
    for s, ref in corpus.metadata["sources"].items():
        by_hand = val_loss_by_hand(store, model_dir, ref, VAL_BLOCKS)
        assert math.isclose(val[f"val_loss/{s}"], by_hand, rel_tol=1e-3), (s, val, by_hand)
    (events,) = (model_dir / "tensorboard").glob("events.out.tfevents.*")
    tags = EventAccumulator(str(events)).Reload().Tags()["scalars"]
    assert {"val/loss", "val/loss/kjv", "val/loss/pystdlib"} <= set(tags)


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
    check_per_source_eval(store, model, corpus)
    check_per_source_val_in_training(store, model, corpus, records)
    before = {kind: sorted(str(m.ref) for m in store.ls(kind)) for kind in VERSIONED}
    assert main(["run", *MIX, "data.mixture.kjv=0.2", "data.mixture.pystdlib=0.8"]) == 0
    tasks = executed(newest_log(in_tmp / "runs"))
    assert "tokenize-shard" not in tasks and tasks.count("train") == 1  # the shard tasks: cache hits
    assert {kind: sorted(str(m.ref) for m in store.ls(kind)) for kind in VERSIONED} == before
    models = {m.metadata["mixture"]["pystdlib"]["weight"]: m for m in store.ls("model")}
    assert sorted(models) == [0.3, 0.8] and models[0.8].parents[0] == str(corpus.ref)
    assert models[0.8].metadata["identity"] != models[0.3].metadata["identity"]


def test_a_capped_source_that_cannot_feed_its_share_is_refused_before_any_task(in_tmp, capfd):  # noqa: F811
    """Point 7: judged from the source's bytes before tokenize (at most one block per seq_len + 1
    bytes): one line with the numbers, no task run, nothing stored."""
    assert main(["run", *MIX, "data.sources.kjv.max_epochs=0.001"]) == 2
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "data.sources.kjv.max_epochs=0.001: the run draws about 56 samples of kjv (weight 0.7 x 80)" in err
    assert not (in_tmp / "local_outputs").exists() and not (in_tmp / "artifacts").exists()


@pytest.mark.chaos_slow  # 70 s, two whole runs: in `make chaos`, beside the learning-rate Optuna sweep
def test_an_optuna_sweep_over_a_weight_reads_a_sources_bits_per_byte_from_the_store(in_tmp, capfd):  # noqa: F811
    """Acceptance 5: Hydra's Optuna sweeper samples kjv's weight (pystdlib's stays: normalised);
    each trial's objective is pystdlib's val bits per byte in its eval artifact; the table has
    both sources' val losses side by side."""
    objective = "val_bits_per_byte/pystdlib"
    sweep = ["hydra/sweeper=optuna", "data.mixture.kjv=interval(0.2,0.8)", "hydra.sweeper.n_trials=2"]
    assert main(["run", "-m", *sweep, *MIX, f"eval.objective={objective}"]) == 0
    (folder,) = (in_tmp / "multirun").glob("*/*")
    md = (folder / "sweep.md").read_text()
    store = open_store(compose(MIX).store)
    rows = [(float(k), float(v)) for k, v in re.findall(r"^\| \d \| data\.mixture\.kjv=(\S+) \| (\S+) \|$", md, re.M)]
    assert len(rows) == 2 and rows[0][0] != rows[1][0]
    for model in store.ls("model"):
        weight = model.metadata["mixture"]["kjv"]["weight"]
        (evaluated,) = [e for e in store.ls("eval") if str(model.ref) in e.parents]
        value = evaluated.metadata["metrics"][objective]
        (row,) = [(k, v) for k, v in rows if math.isclose(k / (k + 0.3), weight)]  # the normalised weight
        assert math.isclose(row[1], value, rel_tol=1e-5), (row, value)
    assert "| val loss kjv | val loss pystdlib |" in md and len(list(store.ls("model"))) == 2
