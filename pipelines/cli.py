"""`liftoff`: the command line. Each subcommand composes `conf/` with Hydra overrides.

liftoff config [overrides]                 the composed, validated config
liftoff artifacts ls [KIND] [overrides]    versions in the store
liftoff artifacts show KIND/NAME[@VERSION] [overrides]   manifest and lineage
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

from omegaconf import OmegaConf

from components.config import compose


def _split(args: list[str]) -> tuple[list[str], list[str]]:
    """Positional words vs Hydra overrides (anything with '=' or a leading '+'/'~')."""
    overrides = [a for a in args if "=" in a or a.startswith(("+", "~"))]
    return [a for a in args if a not in overrides], overrides


def _overrides_only(command: str, args: list[str]) -> list[str]:
    words, overrides = _split(args)
    if words:
        raise UsageError(f"liftoff {command} takes only Hydra overrides (and -m for run/submit), got {words[0]!r}")
    return overrides


def cmd_config(args: list[str]) -> int:
    overrides = _overrides_only("config", args)
    print(OmegaConf.to_yaml(compose(overrides)), end="")
    return 0


def cmd_artifacts(args: list[str]) -> int:
    from components.store import open_store

    words, overrides = _split(args)
    if not words or words[0] not in ("ls", "show"):
        raise UsageError("usage: liftoff artifacts ls [KIND] | show KIND/NAME[@VERSION]  [overrides]")
    cfg = compose(overrides)
    store = open_store(OmegaConf.to_object(cfg.store))
    if words[0] == "ls":
        for m in store.ls(words[1] if len(words) > 1 else None):
            size = sum(f["size"] for f in m.files.values())
            print(f"{m.ref}\t{m.created}\t{len(m.files)} files\t{size} bytes")
        return 0
    if len(words) != 2:
        raise UsageError("usage: liftoff artifacts show KIND/NAME[@VERSION]")
    target = words[1]
    kind_name, _, version = target.partition("@")
    kind, _, name = kind_name.partition("/")
    manifest = store.resolve(kind, name, version or "latest")
    print(manifest.to_json())
    print("lineage:")
    _print_lineage(store.lineage(manifest.ref), 1)
    return 0


def _print_lineage(node: dict, depth: int) -> None:
    note = " (missing)" if node.get("missing") else f"  created {node.get('created')}  code {node.get('code_version')}"
    print("  " * depth + node["ref"] + note)
    for parent in node["parents"]:
        _print_lineage(parent, depth + 1)


def cmd_plan(args: list[str]) -> int:
    """Memory, FLOPs and step time for a config, no hardware needed; exit 1 when it cannot fit."""
    from components.preflight.plan import fits, format_plan, plan_for

    cfg = OmegaConf.to_object(compose(_overrides_only("plan", args)))
    p, device_gb = plan_for(cfg)
    safety = cfg.preflight.memory_safety
    print(format_plan(p, device_gb, safety))
    if not fits(p, device_gb, safety):
        print(
            f"liftoff plan: does not fit: {p.total_gb:.2f} GB per device > {device_gb:.2f} GB x "
            f"preflight.memory_safety={safety} = {device_gb * safety:.2f} GB",
            file=sys.stderr,
        )
        return 1
    print(f"fits: {p.total_gb:.3f} GB of {device_gb * safety:.2f} GB per device")
    return 0


def _multirun(args: list[str]) -> tuple[bool, list[str]]:
    multi = "-m" in args or "--multirun" in args
    return multi, [a for a in args if a not in ("-m", "--multirun")]


def cmd_run(args: list[str]) -> int:
    """The whole DAG locally through kfp.local: a status line per stage, then where everything
    is; `-v` streams every process's log as well; `-m` sweeps and ends with a table."""
    from pipelines.local import display_path, expand_sweep, multirun_folder, new_run_folder, run_local
    from pipelines.progress import summary_lines

    verbose = "-v" in args or "--verbose" in args
    multi, args = _multirun([a for a in args if a not in ("-v", "--verbose")])
    overrides = _overrides_only("run", args)
    jobs = expand_sweep(overrides) if multi else [overrides]
    configs = [compose(job) for job in jobs]  # every job's config is checked before the first runs
    sweep = multirun_folder() if multi else None
    rows = []
    for i, (job, cfg) in enumerate(zip(jobs, configs, strict=True)):
        folder = new_run_folder(cfg, job, sweep / str(i) if sweep else None)
        print(f"== {' '.join(['liftoff run', *job])}  ({display_path(folder)})", flush=True)
        known = _model_refs(cfg)
        result = run_local(cfg, folder, verbose)
        for line in summary_lines(result):
            print(line)
        rows.append((job, result, _model_ref(result) in known))
    if multi:
        table = _sweep_table(rows)
        (sweep / "sweep.md").write_text("\n".join(table) + "\n")
        print("\n" + "\n".join(table))
    return 0


def _model_refs(cfg) -> set[str]:
    """The model versions in the store before a job runs: one it ends with again was reused."""
    from components.store import open_store

    return {str(m.ref) for m in open_store(OmegaConf.to_object(cfg.store)).ls("model")}


def _model_ref(result: dict) -> str | None:
    train = result["stages"].get("train")
    return train.outputs.get("Output") if train is not None else None


def _sweep_table(rows: list) -> list[str]:
    """One row per job: its overrides, model version, train and val loss, throughput, wall time,
    and whether its model was already in the store (reused from an earlier run)."""
    head = "| job | overrides | model | train loss | val loss | val perplexity | tokens/s | wall s | reused |"
    lines = [head, "|---" * 9 + "|"]
    for i, (job, result, reused) in enumerate(rows):
        m = result["metrics"]
        train = result["stages"].get("train")
        t = dict(getattr(train.outputs.get("metrics"), "metadata", None) or {}) if train is not None else {}
        model = (_model_ref(result) or "-").split("@")[-1]
        cells = [str(i), " ".join(job) or "(defaults)", model, f"{t.get('final_loss', float('nan')):.4f}"]
        cells += [f"{m['val_loss']:.4f}", f"{m['val_perplexity']:.2f}", f"{t.get('tokens_per_s', 0):,.0f}"]
        cells += [f"{result['seconds']:.0f}", "yes (same model as before)" if reused else "no"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def cmd_compile(args: list[str]) -> int:
    from pathlib import Path

    from pipelines.cluster import BUILD, compile_pipeline

    overrides = _overrides_only("compile", args)
    path = compile_pipeline(compose(overrides), Path(BUILD) / "pretrain.yaml")
    print(f"compiled {path}")
    return 0


def cmd_render(args: list[str]) -> int:
    """What a cluster run would create: build/pretrain.yaml and build/jobs/{train,preflight}.yaml."""
    from pipelines.cluster import render

    overrides = _overrides_only("render", args)
    for path in render(compose(overrides)):
        print(f"wrote {path}")
    return 0


def cmd_upload(args: list[str]) -> int:
    from pipelines.cluster import upload

    overrides = _overrides_only("upload", args)
    print(upload(compose(overrides)))
    return 0


def cmd_submit(args: list[str]) -> int:
    """Submit to Kubeflow Pipelines; `--wait` follows every run and exits 1 unless all succeed."""
    from pipelines.cluster import run_url, submit, sweep_name, wait
    from pipelines.local import expand_sweep

    follow = "--wait" in args
    multi, args = _multirun([a for a in args if a != "--wait"])
    overrides = _overrides_only("submit", args)
    jobs = expand_sweep(overrides) if multi else [overrides]
    configs = [compose(job) for job in jobs]
    experiment = configs[0].kfp.experiment or sweep_name(overrides)
    runs = []
    for job, cfg in zip(jobs, configs, strict=True):
        run_id = submit(cfg, job, experiment)
        runs.append((cfg, run_id))
        print(
            f"submitted run {run_id} ({' '.join(job) or 'defaults'}) to experiment {experiment}: {run_url(cfg, run_id)}"
        )
    if not follow:
        return 0
    states = [(run_id, wait(cfg, run_id, timeout_s=cfg.kfp.wait_timeout_s)) for cfg, run_id in runs]
    for run_id, state in states:
        print(f"run {run_id}: {state}")
    return 0 if all(state == "SUCCEEDED" for _, state in states) else 1


class UsageError(ValueError):
    pass


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "config": cmd_config,
    "artifacts": cmd_artifacts,
    "plan": cmd_plan,
    "run": cmd_run,
    "compile": cmd_compile,
    "render": cmd_render,
    "upload": cmd_upload,
    "submit": cmd_submit,
}


def main(argv: list[str] | None = None) -> int:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from components.store import StoreError
    from pipelines.cluster import KfpError
    from pipelines.local import RunFailed

    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"liftoff: unknown command {argv[0]!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        return command(argv[1:])
    # ValueError covers ConfigError, UsageError and Hydra's own override errors
    except (HydraException, OmegaConfBaseException, ValueError, StoreError, KfpError, RunFailed) as e:
        print(f"liftoff {argv[0]}: {_one_line(e)}", file=sys.stderr)
        return 2


def _one_line(e: BaseException) -> str:
    """Hydra and OmegaConf errors span lines of context; keep the ones that say what is wrong."""
    text = f"{e}: {e.__cause__}" if e.__cause__ is not None and str(e.__cause__) not in str(e) else str(e)
    noise = ("Config search path", "provider=", "reference_type", "object_type")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith(noise)]
    out = ""
    for ln in lines:
        out += ("" if not out else " " if out.endswith(":") else "; ") + ln
    return out or type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
