"""A sweep optimizes the metric `eval.objective` names, read from each trial's eval artifact in
the store: not val_loss whatever it names."""

from __future__ import annotations

import json

from omegaconf import OmegaConf

from components.config import compose
from components.store import Ref, open_store
from pipelines.sweep import hydra_sweep


def test_a_trials_objective_is_the_metric_eval_objective_names_in_its_stored_eval(tmp_path):
    store_args = [f"store.root={tmp_path / 'store'}", f"store.cache_dir={tmp_path / 'cache'}"]
    # val_loss and val_bits_per_byte rank the two trials in opposite orders
    stored = {
        "0.001": {"val_loss": 2.5, "val_bits_per_byte": 1.75, "val_perplexity": 12.2},
        "0.002": {"val_loss": 3.5, "val_bits_per_byte": 1.25, "val_perplexity": 33.1},
    }

    def run_trial(job, cfg, out):  # a trial's run, as far as its eval artifact in the store
        lr = next(o.split("=", 1)[1] for o in job if o.startswith("train.lr="))
        src = out / "eval"
        src.mkdir(parents=True)
        (src / "metrics.json").write_text(json.dumps(stored[lr]))
        store = open_store(OmegaConf.to_object(cfg.store))
        manifest = store.publish("eval", "tiny", f"lr{lr}", src, metadata={"metrics": stored[lr]})
        return {"eval": str(manifest.ref)}

    overrides = ["train.lr=0.001,0.002", "eval.objective=val_bits_per_byte", *store_args]
    trials, _, direction = hydra_sweep(overrides, tmp_path / "sweep", run_trial)

    assert direction == "minimize" and len(trials) == 2
    store = open_store(OmegaConf.to_object(compose(store_args).store))
    for t in trials:
        metrics = store.manifest(Ref.parse(t.result["eval"])).metadata["metrics"]
        assert t.value == metrics["val_bits_per_byte"] and t.value != metrics["val_loss"], (t.value, metrics)
    assert min(trials, key=lambda t: t.value).swept == ["train.lr=0.002"]  # the best by bits per byte
