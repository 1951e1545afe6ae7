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


def test_an_optuna_sweep_stopped_after_two_trials_runs_only_the_third_when_run_again(tmp_path, monkeypatch):
    """Issue 43, point 5: the study is stored (SQLite, multirun/optuna.db): a sweep of three
    trials whose third run fails, run again, resumes the same study with one trial, and a third
    run of it has nothing left to do (one line, SweepDone)."""
    import optuna
    import pytest

    from pipelines.sweep import STUDIES, SweepDone

    monkeypatch.chdir(tmp_path)
    store_args = [f"store.root={tmp_path / 'store'}", f"store.cache_dir={tmp_path / 'cache'}"]
    ran: list[str] = []

    def run_trial(job, cfg, out):
        lr = next(o.split("=", 1)[1] for o in job if o.startswith("train.lr="))
        if len(ran) == 2 and not resumed:
            raise RuntimeError("the machine went away")  # the first invocation dies in its third trial
        ran.append(lr)
        metrics = {"val_loss": abs(float(lr) - 0.004)}
        (out / "eval").mkdir(parents=True)
        (out / "eval" / "metrics.json").write_text(json.dumps(metrics))
        store = open_store(OmegaConf.to_object(cfg.store))
        return {
            "eval": str(store.publish("eval", "tiny", f"t{len(ran)}", out / "eval", metadata={"metrics": metrics}).ref)
        }

    sweep = ["hydra/sweeper=optuna", "train.lr=interval(1e-3,1e-2)", "hydra.sweeper.n_trials=3",
             "hydra.sweeper.n_jobs=1", "hydra.sweeper.sampler.seed=1", *store_args]  # fmt: skip
    resumed = False
    with pytest.raises(BaseException) as died:  # Hydra wraps the trial's exception
        hydra_sweep(sweep, tmp_path / "multirun" / "a", run_trial)
    assert len(ran) == 2 and STUDIES.is_file(), died.value
    resumed = True
    trials, best, _ = hydra_sweep(sweep, tmp_path / "multirun" / "b", run_trial)
    assert len(trials) == 1 and len(ran) == 3  # the one trial the study lacked
    assert len(set(ran)) == 3, ran  # a new point, not the seeded sampler's first one again
    (study,) = optuna.get_all_study_summaries(f"sqlite:///{STUDIES.resolve()}")
    complete = [t for t in optuna.load_study(study_name=study.study_name, storage=f"sqlite:///{STUDIES.resolve()}")
                .get_trials() if t.state == optuna.trial.TrialState.COMPLETE]  # fmt: skip
    assert sorted(t.params["train.lr"] for t in complete) == sorted(float(x) for x in ran)
    assert best["best_value"] == min(abs(float(x) - 0.004) for x in ran)  # over all three, not the last only
    with pytest.raises(SweepDone, match=r"has its 3 trial\(s\): raise hydra.sweeper.n_trials"):
        hydra_sweep(sweep, tmp_path / "multirun" / "c", run_trial)


def test_the_sweep_page_plots_whole_trial_numbers_and_rounds_the_sampled_values():
    """Issue 43, point 5: three trials on a plot whose ticks are trial numbers (no 0.25), and
    17-digit sampled learning rates shown to four significant figures (sweep.md keeps them exact)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pipelines.sweep import Trial, per_trial, summary_html

    lrs = ["0.0012345678901234567", "0.0087654321098765432", "0.004"]
    trials = [
        Trial(i, [f"train.lr={lr}", "train.steps=10"], 3.0 - i / 3, {}, [f"train.lr={lr}"]) for i, lr in enumerate(lrs)
    ]
    fig, ax = plt.subplots()
    per_trial(ax, trials, [t.value for t in trials], "val_loss")
    fig.canvas.draw()
    ticks = [t for t in ax.get_xticks() if -0.5 <= t <= 2.5]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    plt.close(fig)
    html = summary_html(trials, "val_loss", "minimize", None)
    assert "train.lr=0.001235" in html and "train.lr=0.008765" in html and "train.lr=0.004<" in html
    assert "0012345678901234567" not in html.split("<script")[0]  # the page's data block keeps them exact
