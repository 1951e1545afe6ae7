"""Running the pipeline on this machine: `liftoff run` and its sweeps, through kfp.local."""

from __future__ import annotations

import builtins
import contextlib
import itertools
import os
import re
import shutil
import time
import uuid
import warnings
from collections.abc import Mapping
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from components import summaries
from components.config import compose_choices, group_dicts
from components.local_pod import TASK_ROOT_ENV
from components.store import Ref, open_store
from pipelines.interrupt import stopped_by_signals
from pipelines.progress import Console, display_path, plain, watch_stages
from pipelines.summary import StageLines, keep_outputs

LOCAL_ROOT = Path("local_outputs")
LOG_NAME = "run.log"  # in the run's folder: everything the run's processes printed


class RunFailed(RuntimeError):
    """A stage failed; the message names it, its cause and the run's full log."""


def expand_sweep(overrides: list[str]) -> list[list[str]]:
    """Hydra's basic sweeper: the cartesian product of every `key=a,b,c` override."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    choices = []
    for o in OverridesParser.create().parse_overrides(overrides):
        if o.is_sweep_override():
            key = o.get_key_element()
            choices.append([f"{key}={v}" for v in o.sweep_string_iterator()])
        else:
            choices.append([o.input_line])
    return [list(job) for job in itertools.product(*choices)]


def missing_sources(cfg: DictConfig) -> str | None:
    """Why the local data.paths cannot be read, in one line (None when they are all there):
    checked before the run starts, where tokenize would find it only once the pipeline ran.
    Relative paths are from the current directory, as `local_parameters` resolves them."""
    every = [*cfg.data.paths, *(p for s in cfg.data.sources.values() for p in (s.paths or []))]
    missing = [p for p in every if not p.startswith("s3://") and not Path(p).expanduser().exists()]
    if not missing:
        return None
    relative = [p for p in missing if not Path(p).expanduser().is_absolute()]
    where = f" (relative to {Path.cwd()})" if relative else ""
    return f"data.paths: {', '.join(missing)} {'does' if len(missing) == 1 else 'do'} not exist{where}"


def mixture_refusal(cfg: DictConfig) -> str | None:
    """A mixture whose capped source cannot feed its share of the run, from the source bytes
    (`pipelines.cluster.mixture_fit_refusal`); None for one source."""
    if not cfg.data.sources:
        return None
    from components.prelaunch import blocks_per_step
    from pipelines.cluster import mixture_fit_refusal

    typed = OmegaConf.to_object(cfg)
    _, per_step = blocks_per_step(typed.train, typed.cluster)
    return mixture_fit_refusal(typed.data, typed.train.steps * per_step, Path.cwd())


def run_local(cfg: DictConfig, folder: Path | None = None, verbose: bool = False) -> dict:
    """The whole DAG through kfp.local (SubprocessRunner, current interpreter, caching on).
    What every process of the run prints goes to `folder`/run.log (and, `verbose`, to the
    terminal); the terminal gets one status line per stage as it starts and ends."""
    import kfp.local

    from pipelines.pretrain import build_pipeline

    store = open_store(OmegaConf.to_object(cfg.store))  # an unreachable store fails here, before any stage
    folder = folder or new_run_folder(cfg, [])
    log_path = folder / LOG_NAME
    root = LOCAL_ROOT.resolve()
    kfp.local.init(
        runner=kfp.local.SubprocessRunner(use_venv=False), pipeline_root=str(root / "kfp"), enable_caching=True
    )
    t0 = time.perf_counter()
    with task_directories(root / "tasks"), Console(log_path, verbose) as console, warnings.catch_warnings():
        # kfp.local warns on every task that the stage image is not a Python image: it runs
        # the tasks in this interpreter (SubprocessRunner) and never pulls the image
        warnings.filterwarnings("ignore", message="You may be attemping to run a task that uses custom or non-Python")
        stages = StageLines(cfg, console.say)
        where = lambda: interruption_line(cfg, stages, console.last_step, store)  # noqa: E731
        with watch_stages(stages.start, stages.end, console.sync), print_kept(), stopped_by_signals(where):
            try:
                task = build_pipeline(cfg)(**local_parameters(group_dicts(cfg)))
            except RuntimeError as e:
                failed, where = stages.failed, f"(full log: {display_path(log_path)})"
                if failed is None:
                    raise RunFailed(f"{plain(str(e).splitlines()[0])} {where}") from None
                cause = failed.cause or "it handed back no cause (it ended before its stage began, or was killed)"
                raise RunFailed(f"stage {failed.name} failed: {cause} {where}") from None
        files = keep_outputs(folder, stages.ends, store)  # before the tasks' directories go
    eval_ref = task.output if isinstance(task.output, str) else task.outputs["Output"]
    evaluation = store.manifest(Ref.parse(eval_ref))
    return {
        "eval": eval_ref,
        "metrics": evaluation.metadata["metrics"],
        "lineage": store.lineage(evaluation.ref),
        "seconds": time.perf_counter() - t0,
        "kfp_root": str(root / "kfp"),
        "cfg": cfg,
        "folder": folder,
        "log": log_path,
        "stages": stages.ends,
        "files": files,
    }


def interruption_line(cfg: DictConfig, stages: StageLines, step: int | None, store) -> str:
    """`interrupted during train (step 25); a rerun resumes from checkpoint/NAME@VERSION`: where
    the run was and what the store holds for a rerun to continue."""
    stage = stages.current or "start-up"
    at = f" (step {step})" if stage == "train" and step is not None else ""
    newest = _newest_checkpoint(cfg, stages, store)
    if newest is not None:
        after = f"a rerun resumes from {newest}"
    elif stage in ("tokenize", "start-up"):
        after = "a rerun starts again; finished tokenize shards are reused"
    else:
        after = "a rerun reuses the finished stages" + (" and trains from step 0" if stage == "train" else "")
    return f"interrupted during {stage}{at}; {after}"


def _newest_checkpoint(cfg: DictConfig, stages: StageLines, store) -> str | None:
    """The newest stored checkpoint of this run's training identity, once its dataset is known."""
    from components.identity import training_identity
    from components.mixture import identity_of

    tokenize = stages.ends.get("tokenize")
    dataset = getattr(summaries.find(tokenize.outputs), "ref", None) if tokenize else None  # its TokenizeSummary
    if not dataset:
        return None
    data = OmegaConf.to_object(cfg.data)
    mixture = identity_of(data, store.manifest(Ref.parse(dataset)))
    identity = training_identity(dataset, OmegaConf.to_object(cfg.model), OmegaConf.to_object(cfg.train), mixture)
    mine = [m for m in store.versions("checkpoint", cfg.model.name) if m.metadata.get("identity") == identity]
    newest = max(mine, key=lambda m: (m.metadata.get("step", -1), m.created), default=None)
    return str(newest.ref) if newest is not None else None


@contextlib.contextmanager
def task_directories(parent: Path):
    """Each KFP task of this run in a directory of its own, as in its own pod, under one folder
    for the run that is removed when it ends (the tasks' caches hold copies of the artifacts)."""
    run_tasks = parent / uuid.uuid4().hex[:12]
    os.environ[TASK_ROOT_ENV] = str(run_tasks)
    try:
        yield run_tasks
    finally:
        os.environ.pop(TASK_ROOT_ENV, None)
        shutil.rmtree(run_tasks, ignore_errors=True)


def new_run_folder(
    cfg: DictConfig, overrides: list[str], folder: Path | None = None, choices: Mapping[str, str | None] | None = None
) -> Path:
    """A run's folder, as Hydra names one: `<train.run_dir>/<experiment>/<date>_<time>_<short
    overrides>/` (a sweep job's is given: `multirun/<date>/<time>/<job>/`), holding the composed
    config and the overrides in `.hydra/`. `choices`: Hydra's, from `compose_choices(overrides)`
    (composed here when not given and the folder is to be named)."""
    if folder is None:
        if choices is None:
            _, choices = compose_choices(overrides)
        name = time.strftime("%Y-%m-%d_%H-%M-%S") + (f"_{short_overrides(overrides)}" if overrides else "")
        folder = Path(cfg.train.run_dir) / str(choices.get("experiment") or "default") / name
        for n in itertools.count(1):
            if not folder.exists():
                break
            folder = folder.with_name(f"{name}-{n}")
    (folder / ".hydra").mkdir(parents=True, exist_ok=True)
    (folder / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    (folder / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(list(overrides))))
    return folder


def multirun_folder() -> Path:
    """A sweep's folder, as Hydra's: `multirun/<date>/<time>/`; its jobs are `0/`, `1/`, ..."""
    return Path("multirun") / time.strftime("%Y-%m-%d") / time.strftime("%H-%M-%S")


def short_overrides(overrides: list[str], limit: int = 48) -> str:
    """`train.lr=1e-3 data.paths=[/a/b.jsonl]` -> `lr=1e-3,paths=b.jsonl`: a folder name
    TensorBoard and `ls` can tell runs apart by."""
    parts = []
    for o in overrides:
        key, _, value = o.lstrip("+~").partition("=")
        value = ",".join(Path(v.strip()).name or v for v in value.strip("[]").split(","))
        parts.append(re.sub(r"[^\w.,=+-]", "_", f"{key.rsplit('.', 1)[-1]}={value}"))
    name = ",".join(parts)
    return name if len(name) <= limit else name[:limit].rsplit(",", 1)[0]  # whole overrides only


@contextlib.contextmanager
def print_kept():
    """kfp.local indents a task's output by swapping `builtins.print` while the task runs; the
    iterations of a ParallelFor run in threads whose swaps interleave, so one can leave an
    indenting print in place for the rest of the process. The original comes back after a run."""
    original = builtins.print
    try:
        yield
    finally:
        builtins.print = original


def local_parameters(groups: dict[str, dict]) -> dict[str, dict]:
    """The pipeline's parameters for a run on this machine: the paths that stand for shared
    places (the local store standing in for MinIO, the run folders) made absolute, since every
    task runs in a directory of its own; so are relative data paths (`corpus/kjv.jsonl`), which
    in a stage's image are relative to its working directory, the checkout's copy."""
    groups = {g: dict(values) for g, values in groups.items()}

    def resolved(paths: list[str]) -> list[str]:
        return [p if p.startswith("s3://") else str(Path(p).expanduser().resolve()) for p in paths]

    groups["data"]["paths"] = resolved(groups["data"]["paths"])
    sources = {name: dict(src) for name, src in groups["data"].get("sources", {}).items()}
    for src in sources.values():
        if "paths" in src:
            src["paths"] = resolved(src["paths"])
    groups["data"]["sources"] = sources
    if groups["store"]["backend"] == "local":
        groups["store"]["root"] = str(Path(groups["store"]["root"]).resolve())
    groups["train"]["run_dir"] = str(Path(groups["train"]["run_dir"]).resolve())
    return groups
