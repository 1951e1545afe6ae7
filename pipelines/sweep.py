"""Sweeps: `liftoff run -m` (and `submit -m`) with Hydra's sweepers.

The basic sweeper (the default) is expanded here, every job's config checked before the first
runs (pipelines/local.py `expand_sweep`). Any other sweeper, `hydra/sweeper=optuna` (Hydra's
Optuna sweeper plugin), runs through Hydra's own multirun: the plugin samples each trial's
overrides and reads back the objective, which here is a metric of the trial's eval artifact in
the store (`eval.objective`, val_loss by default; `hydra.sweeper.direction` says which way is
better). Before the first trial, each swept key is composed at the ends of its range (every
choice of a `choice`), so a search space the config rules refuse fails at once, in one line.
The sweep folder gets `sweep.md` (every trial, its objective, the best) and `sweep.html` (the
objective per trial and, with scikit-learn, each parameter's importance: Optuna's mean decrease
in impurity of a random forest fitted to the trials; its fANOVA fails on this numpy).
"""

from __future__ import annotations

import base64
import io
import json
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from components import page, summaries
from components.config import CONF_DIR, ConfigError, compose


@dataclass
class Trial:
    number: int
    overrides: list[str]
    value: float
    result: dict = field(repr=False)
    swept: list[str] = field(default_factory=list)  # the overrides the sweeper chose for this trial

    @property
    def fixed(self) -> list[str]:
        return [o for o in self.overrides if o not in self.swept]


def sweeper_of(overrides: list[str]) -> str:
    """The `hydra/sweeper=NAME` override's NAME; `basic` without one."""
    chosen = [o.split("=", 1)[1] for o in overrides if o.startswith("hydra/sweeper=")]
    return chosen[-1] if chosen else "basic"


def without_hydra(overrides: list[str]) -> list[str]:
    """The overrides of the experiment itself (a basic sweep's jobs): no `hydra/...`, `hydra.*`."""
    return [o for o in overrides if not o.lstrip("+~").startswith(("hydra/", "hydra."))]


def check_search_space(overrides: list[str]) -> None:
    """Compose each swept key at its range's ends (each choice), the others at their first value."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(without_hydra(overrides))
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    for o in parsed:
        if not o.is_sweep_override():
            continue
        for value in _ends(o):
            others = [f"{p.get_key_element()}={_ends(p)[0]}" for p in parsed if p.is_sweep_override() and p is not o]
            try:
                compose([*fixed, *others, f"{o.get_key_element()}={value}"])
            except (ConfigError, ValueError) as e:
                raise ConfigError(f"search space {o.input_line}: at {value}: {e}") from None


def _is_sweep(override: str) -> bool:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_override(override).is_sweep_override()


def _ends(o) -> list:
    value = o.value()
    if o.is_interval_sweep():
        return [value.start, value.end]
    if o.is_range_sweep():
        items = list(o.sweep_string_iterator())
        return [items[0], items[-1]] if items else []
    return list(o.sweep_string_iterator())


STUDIES = Path("multirun") / "optuna.db"  # every Optuna study of this folder's sweeps (SQLite)


def _given(overrides: list[str], key: str) -> str | None:
    found = [o.split("=", 1)[1] for o in overrides if o.startswith(key + "=")]
    return found[-1] if found else None


def optuna_study(overrides: list[str]) -> list[str]:
    """The overrides that store an Optuna sweep's study and resume it: `hydra.sweeper.storage`
    (default: SQLite in multirun/optuna.db), `study_name` (default: named after the sweep's
    overrides, trial count aside) and `n_trials`, the trials the study still lacks. A sweep
    stopped after k of n trials, run again, runs the n - k left; SweepDone when none is."""
    import optuna
    from hydra_plugins.hydra_optuna_sweeper.config import OptunaSweeperConf

    from pipelines.cluster import sweep_name

    storage = _given(overrides, "hydra.sweeper.storage")
    if storage is None:
        STUDIES.parent.mkdir(parents=True, exist_ok=True)
        storage = f"sqlite:///{STUDIES.resolve()}"
    name = _given(overrides, "hydra.sweeper.study_name")
    name = name or sweep_name([o for o in overrides if not o.startswith("hydra.sweeper.n_trials=")])
    wanted = int(_given(overrides, "hydra.sweeper.n_trials") or OptunaSweeperConf.n_trials)
    try:
        trials = optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
    except KeyError:  # no such study yet
        trials = []
    done = sum(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    if done >= wanted:
        raise SweepDone(f"study {name} in {storage} has its {done} trial(s): raise hydra.sweeper.n_trials to go on")
    if done:
        print(f"resuming Optuna study {name}: {done} of {wanted} trial(s) done ({storage})", flush=True)
    seed = _given(overrides, "hydra.sweeper.sampler.seed")
    reseeded = [f"hydra.sweeper.sampler.seed={int(seed) + done}"] if seed is not None and done else []
    # (a resumed sampler seeded as the first draws the first's points again: on by the trials done)
    replaced = ("hydra.sweeper.storage=", "hydra.sweeper.study_name=", "hydra.sweeper.n_trials=")
    replaced += ("hydra.sweeper.sampler.seed=",) if reseeded else ()
    kept = [o for o in overrides if not o.startswith(replaced)]
    return [*kept, f"hydra.sweeper.storage={storage}", f"hydra.sweeper.study_name={name}",
            f"hydra.sweeper.n_trials={wanted - done}", *reseeded]  # fmt: skip


class SweepDone(ConfigError):
    """An Optuna study already has the trials asked for: nothing to run."""


def hydra_sweep(
    overrides: list[str], sweep_dir: Path, run_trial: Callable[[list[str], DictConfig, Path], dict]
) -> tuple[list[Trial], dict, str]:
    """Run Hydra's multirun with the chosen sweeper; each trial's objective from the store.
    (trials in order, optimization_results.yaml as the sweeper wrote it, the direction)."""
    from hydra import version
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    check_search_space(overrides)
    keys = {o.split("=", 1)[0] for o in without_hydra(overrides) if "=" in o and _is_sweep(o)}
    trials: list[Trial] = []
    direction = ["minimize"]

    def task(_: DictConfig) -> float:
        hc = HydraConfig.get()
        chosen = hc.sweeper.get("direction", "minimize")  # the plugin's Direction enum, or its name
        if OmegaConf.is_list(chosen):
            raise ConfigError("hydra.sweeper.direction: one objective (eval.objective), so one direction")
        direction[0] = str(getattr(chosen, "name", chosen)).rsplit(".", 1)[-1]
        job = list(hc.overrides.task)
        cfg = compose(job)  # the trial's config, held to every rule like any other run's
        result = run_trial(job, cfg, Path(hc.runtime.output_dir))
        value = objective_of(result, cfg)
        swept = [o for o in job if o.split("=", 1)[0] in keys]
        trials.append(Trial(len(trials), job, value, result, swept))
        return value

    logging.getLogger("alembic").setLevel(logging.WARNING)  # optuna's storage layer: plugin chatter on import
    if sweeper_of(overrides) == "optuna":
        overrides = optuna_study(overrides)
    version.setbase("1.3")
    GlobalHydra.instance().clear()
    hydra = Hydra.create_main_hydra2(task_name="liftoff", config_search_path=create_config_search_path(str(CONF_DIR)))
    quiet = ["hydra/job_logging=none", "hydra/hydra_logging=none", f"hydra.sweep.dir={sweep_dir}"]
    try:
        hydra.multirun(config_name="config", task_function=task, overrides=[*overrides, *quiet])
    finally:
        GlobalHydra.instance().clear()
    results = sweep_dir / "optimization_results.yaml"
    best = OmegaConf.to_container(OmegaConf.load(results)) if results.is_file() else {}
    return trials, best, direction[0]


def objective_of(result: dict, cfg: DictConfig) -> float:
    """`eval.objective` of the trial's eval artifact, read back from the store."""
    from components.store import Ref, open_store

    metrics = open_store(OmegaConf.to_object(cfg.store)).manifest(Ref.parse(result["eval"])).metadata["metrics"]
    name = cfg.eval.objective
    if name not in metrics:
        raise ConfigError(
            f"eval.objective={name!r}: {result['eval']} has no such metric ({', '.join(sorted(metrics))})"
        )
    return float(metrics[name])


def submitted_eval(store, cfg: DictConfig, since: float) -> str:
    """The eval artifact a finished cluster run of `cfg` made: an eval of a model of this name
    trained with this training config (every key that shapes the weights), measured with this
    eval config; the newest created since `since` (a run KFP's cache answered publishes
    nothing new: then the newest at all). Raises ConfigError when there is none."""
    from datetime import datetime

    from components.config import as_plain_dict
    from components.evaluate.stage import eval_suffix
    from components.identity import NOT_IDENTITY
    from components.store import Ref

    typed = OmegaConf.to_object(cfg)
    wanted = {k: v for k, v in as_plain_dict(typed.train).items() if k not in NOT_IDENTITY}
    suffix = eval_suffix(typed.eval)
    found = []
    for e in store.ls("eval"):
        model = next((p for p in e.parents if p.startswith(f"model/{typed.model.name}@")), None)
        if model is None or not e.ref.version.endswith(f"-{suffix}"):
            continue
        trained = store.manifest(Ref.parse(model)).metadata.get("train", {})
        if all(trained.get(k) == v for k, v in wanted.items()):
            found.append((datetime.fromisoformat(e.created).timestamp(), str(e.ref)))
    if not found:
        raise ConfigError(f"no eval artifact in {store.description} for the run of {typed.model.name} just finished")
    recent = [f for f in found if f[0] >= since]
    return max(recent or found)[1]


def importance(overrides: list[str], trials: list[Trial]) -> dict[str, float] | None:
    """Each swept parameter's importance over the trials (Optuna's mean-decrease-in-impurity
    evaluator, which needs scikit-learn); None when it cannot be judged (fewer than two trials)."""
    try:
        import optuna
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from hydra_plugins.hydra_optuna_sweeper._impl import create_optuna_distribution_from_override
    except ImportError:
        return None
    parser = OverridesParser.create()
    space = {
        o.get_key_element(): create_optuna_distribution_from_override(o)
        for o in parser.parse_overrides(without_hydra(overrides))
        if o.is_sweep_override()
    }
    if len(trials) < 2 or not space:
        return None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    study = optuna.create_study()
    for t in trials:
        given = {o.get_key_element(): o for o in parser.parse_overrides(t.overrides)}
        params = {k: _typed(d, given[k].get_value_element_as_str()) for k, d in space.items() if k in given}
        study.add_trial(optuna.trial.create_trial(params=params, distributions=space, value=t.value))
    try:
        evaluator = optuna.importance.MeanDecreaseImpurityImportanceEvaluator(seed=0)
        return dict(optuna.importance.get_param_importances(study, evaluator=evaluator))
    except (ImportError, RuntimeError, ValueError):
        return None


def _typed(distribution, text: str):
    import optuna

    if isinstance(distribution, optuna.distributions.CategoricalDistribution):
        return next((c for c in distribution.choices if str(c) == text), text)
    if isinstance(
        distribution, (optuna.distributions.IntUniformDistribution, optuna.distributions.IntLogUniformDistribution)
    ):
        return int(text)
    return float(text)


def best_trial(trials: list[Trial], direction: str) -> Trial:
    pick = min if direction == "minimize" else max
    return pick(trials, key=lambda t: t.value)


def summary_md(trials: list[Trial], best: dict, objective: str, table: list[str], direction: str) -> list[str]:
    """sweep.md: every trial with its objective, then the best and its overrides."""
    winner = best_trial(trials, direction)
    lines = [f"objective: {objective} ({direction}); every trial also ran with {' '.join(winner.fixed) or 'defaults'}"]
    lines += ["", "| trial | swept | " + objective + " |", "|---|---|---|"]
    lines += [f"| {t.number} | {' '.join(t.swept)} | {t.value:.6g} |" for t in trials]
    lines += ["", f"best: trial {winner.number}, {objective} {winner.value:.6g}: {' '.join(winner.swept)}"]
    if best.get("best_params"):
        lines.append(f"the sweeper's best parameters: {json.dumps(best['best_params'])}")
    return [*lines, "", *table]


def _png(draw) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.4))
    draw(ax)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def per_trial(ax, trials: list[Trial], so_far: list[float], objective: str) -> None:
    """The objective of each trial and the best so far, trials on whole-number ticks."""
    from matplotlib.ticker import MaxNLocator

    ax.plot([t.number for t in trials], [t.value for t in trials], "o", color="#1f77b4", label="trial")
    ax.plot([t.number for t in trials], so_far, "-", color="#ff7f0e", label="best so far")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("trial")
    ax.set_ylabel(objective)
    ax.legend()


def shown(overrides: list[str], digits: int = 4) -> str:
    """Overrides as a reader compares them: a sampled float to `digits` significant figures
    (`train.lr=0.0012345678901234567` -> `train.lr=0.001235`); sweep.md keeps them exact."""
    out = []
    for o in overrides:
        key, sep, value = o.partition("=")
        try:
            number = float(value)
            exact = not any(c in value.lower() for c in ".e") or len(value) <= digits + 2
            out.append(o if exact else f"{key}{sep}{number:.{digits}g}")
        except ValueError:
            out.append(o)
    return " ".join(out)


def summary_html(trials: list[Trial], objective: str, direction: str, weights: dict[str, float] | None) -> str:
    winner = best_trial(trials, direction)
    pick = min if direction == "minimize" else max
    so_far = [pick(t.value for t in trials[: i + 1]) for i in range(len(trials))]

    plots = [(_png(lambda ax: per_trial(ax, trials, so_far, objective)), "objective per trial")]
    if weights:

        def bars(ax) -> None:
            names = list(weights)
            ax.barh(names, [weights[n] for n in names], color="#1f77b4")
            ax.set_xlabel("importance (mean decrease in impurity)")

        plots.append((_png(bars), "parameter importance"))
    rows = [[t.number, shown(t.swept), t.value] for t in trials]
    head = {
        "objective": f"{objective} ({direction})",
        "trials": str(len(trials)),
        "best": f"trial {winner.number}: {objective} {winner.value:.6g}, {shown(winner.swept)}",
        "every trial with": " ".join(winner.fixed) or "defaults",
    }
    body = [
        page.header("Sweep", head),
        page.section("plots", "Objective and importance", page.figures(plots)),
        page.section("trials", "Trials", page.table(["trial", "swept", objective], rows, numeric_from=2)),
    ]
    data = json.dumps({"trials": [[t.number, t.overrides, t.value] for t in trials], "importance": weights})
    return page.page("liftoff sweep", body, data)


# the sweep table of `liftoff run -m` (a row per job) and the drivers of a plugin-driven sweep


def model_refs(cfg) -> set[str]:
    """The model versions in the store before a job runs: one it ends with again was reused."""
    from components.store import open_store

    return {str(m.ref) for m in open_store(OmegaConf.to_object(cfg.store)).ls("model")}


def model_ref(result: dict) -> str | None:
    train = result["stages"].get("train")
    return train.outputs.get("Output") if train is not None else None


def sweep_table(rows: list) -> list[str]:
    """One row per job: its overrides, model version, train and val loss, throughput, wall time,
    and whether its model was already in the store (reused from an earlier run)."""
    sources = sorted({k.split("/", 1)[1] for _, r, _ in rows for k in r["metrics"] if k.startswith("val_loss/")})
    head = "| job | overrides | model | started | train loss | val loss | val perplexity | tokens/s | wall s | reused |"
    head = head.replace("| tokens/s", "".join(f"| val loss {s} " for s in sources) + "| tokens/s")
    lines = [head, "|---" * (10 + len(sources)) + "|"]
    for i, (job, result, reused) in enumerate(rows):
        m = result["metrics"]
        train = result["stages"].get("train")
        said = summaries.find(train.outputs) if train is not None else None  # train's TrainSummary
        model = (model_ref(result) or "-").split("@")[-1]
        started = getattr(said, "continued", "-")
        final_loss, tokens_per_s = getattr(said, "final_loss", None), getattr(said, "tokens_per_s", 0)
        cells = [str(i), " ".join(job) or "(defaults)", model, started, f"{_nan(final_loss):.4f}"]
        cells += [f"{m['val_loss']:.4f}", f"{m['val_perplexity']:.2f}"]
        cells += [f"{m[f'val_loss/{s}']:.4f}" if f"val_loss/{s}" in m else "-" for s in sources]
        cells += [f"{tokens_per_s:,.0f}"]
        cells += [f"{result['seconds']:.0f}", "yes (same model as before)" if reused else "no"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _nan(x) -> float:
    return float("nan") if x is None else float(x)


def run_sweep(overrides: list[str], verbose: bool) -> int:
    """A sweep Hydra's sweeper plugin drives (Optuna): each trial a whole local run, its objective
    read from its eval artifact; sweep.md and sweep.html in the sweep's folder."""
    from pipelines.local import display_path, multirun_folder, new_run_folder, run_local
    from pipelines.summary import summary_lines

    sweep = multirun_folder()

    def trial(job: list[str], cfg, folder) -> dict:
        folder = new_run_folder(cfg, job, folder)
        print(f"== {' '.join(['liftoff run', *job])}  ({display_path(folder)})", flush=True)
        known = model_refs(cfg)
        result = run_local(cfg, folder, verbose)
        for line in summary_lines(result):
            print(line)
        return {**result, "reused": model_ref(result) in known}

    trials, best, direction = hydra_sweep(overrides, sweep, trial)
    table = sweep_table([(t.overrides, t.result, t.result["reused"]) for t in trials])
    return _reported(sweep, overrides, trials, best, direction, table)


def submit_sweep(overrides: list[str], skip_doctor: bool = False) -> int:
    """A sweep Hydra's sweeper plugin drives, on Kubeflow Pipelines: each trial one run in the
    sweep's experiment, followed to its end; its objective read from the eval artifact it put in
    the store. A trial that does not succeed ends the sweep (one line, exit 2); each trial is
    checked by the doctor before it is sent, unless skipped."""
    import time

    from components.store import open_store
    from pipelines.cluster import KfpError, run_url, submit, sweep_name, wait
    from pipelines.local import multirun_folder

    sweep, experiment = multirun_folder(), None

    def trial(job: list[str], cfg, folder) -> dict:
        nonlocal experiment
        experiment = experiment or cfg.kfp.experiment or sweep_name(overrides)
        since = time.time()
        run_id = submit(cfg, job, experiment, skip_doctor=skip_doctor)
        print(f"submitted run {run_id} ({' '.join(job)}) to experiment {experiment}: {run_url(cfg, run_id)}")
        state = wait(cfg, run_id, timeout_s=cfg.kfp.wait_timeout_s)
        if state != "SUCCEEDED":
            raise KfpError(f"trial run {run_id} ended {state}: the sweep stops ({run_url(cfg, run_id)})")
        store = open_store(OmegaConf.to_object(cfg.store), create=False)
        return {"eval": submitted_eval(store, cfg, since), "run_id": run_id, "cfg": cfg}

    trials, best, direction = hydra_sweep(overrides, sweep, trial)
    return _reported(sweep, overrides, trials, best, direction, [])


def _reported(sweep: Path, overrides: list[str], trials: list[Trial], best: dict, direction: str, table) -> int:
    """sweep.md and sweep.html in the sweep's folder; the summary printed."""
    from pipelines.local import display_path

    objective = trials[0].result["cfg"].eval.objective
    lines = summary_md(trials, best, objective, table, direction)
    (sweep / "sweep.md").write_text("\n".join(lines) + "\n")
    (sweep / "sweep.html").write_text(summary_html(trials, objective, direction, importance(overrides, trials)))
    print("\n" + "\n".join(lines) + f"\nsweep: {display_path(sweep)}/sweep.md, sweep.html")
    return 0
