"""Running the pipeline on this machine: `liftoff run` and its sweeps, through kfp.local."""

from __future__ import annotations

import itertools
import os
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from components.config import group_dicts
from components.local_pod import TASK_ROOT_ENV
from components.store import Ref, open_store

LOCAL_ROOT = Path("local_outputs")


class RunFailed(RuntimeError):
    """A stage failed; the message names it (its log is above)."""


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


def run_local(cfg: DictConfig) -> dict:
    """The whole DAG through kfp.local (SubprocessRunner, current interpreter, caching on)."""
    import kfp.local

    from pipelines.pretrain import build_pipeline

    store = open_store(OmegaConf.to_object(cfg.store))  # an unreachable store fails here, before any stage
    root = LOCAL_ROOT.resolve()
    kfp.local.init(
        runner=kfp.local.SubprocessRunner(use_venv=False), pipeline_root=str(root / "kfp"), enable_caching=True
    )
    os.environ[TASK_ROOT_ENV] = str(root / "tasks")  # each task in its own directory, as in its own pod
    t0 = time.perf_counter()
    try:
        task = build_pipeline(cfg)(**local_parameters(group_dicts(cfg)))
    except RuntimeError as e:
        raise RunFailed(f"the pipeline failed: {str(e).splitlines()[0]} (the stage's log is above)") from None
    eval_ref = task.output if isinstance(task.output, str) else task.outputs["Output"]
    evaluation = store.manifest(Ref.parse(eval_ref))
    lineage = store.lineage(evaluation.ref)
    return {
        "eval": eval_ref,
        "report": str(store.fetch(evaluation) / "report.html"),  # kfp.local's copy has no extension
        "metrics": evaluation.metadata["metrics"],
        "lineage": lineage,
        "seconds": time.perf_counter() - t0,
        "kfp_root": str(root / "kfp"),
    }


def local_parameters(groups: dict[str, dict]) -> dict[str, dict]:
    """The pipeline's parameters for a run on this machine: the paths that stand for shared
    places (the local store standing in for MinIO, the run folders) made absolute, since every
    task runs in a directory of its own."""
    groups = {g: dict(values) for g, values in groups.items()}
    if groups["store"]["backend"] == "local":
        groups["store"]["root"] = str(Path(groups["store"]["root"]).resolve())
    groups["train"]["run_dir"] = str(Path(groups["train"]["run_dir"]).resolve())
    return groups


def flatten_lineage(node: dict) -> list[str]:
    out = [node["ref"]]
    for parent in node["parents"]:
        out += [r for r in flatten_lineage(parent) if r not in out]
    return out


def print_summary(result: dict) -> None:
    print("\nartifacts:", file=sys.stdout)
    for ref in flatten_lineage(result["lineage"]):
        print(f"  {ref}")
    print("metrics:")
    for name, value in result["metrics"].items():
        print(f"  {name}: {value:.6g}")
    print(f"kfp.local outputs: {result['kfp_root']}  ({result['seconds']:.0f}s)")
    print(f"eval report: {result['report']}")
