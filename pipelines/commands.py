"""The `liftoff` commands: each `cmd_NAME(args)` takes the words after `liftoff NAME`, composes
`conf/` with the Hydra overrides among them and returns the exit status; its docstring is what
`liftoff NAME --help` shows."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from omegaconf import OmegaConf

from components.config import ConfigError, compose, compose_choices, config_groups
from components.summaries import gib
from pipelines.artifacts import USAGE as ARTIFACTS_USAGE
from pipelines.artifacts import UsageError, is_directory


def _split(args: list[str]) -> tuple[list[str], list[str]]:
    """Positional words vs Hydra overrides (anything with '=' or a leading '+'/'~'), except a
    directory: a run folder's name holds its overrides (`runs/tiny/<date>_<time>_lr=3e-3`)."""
    overrides = [a for a in args if ("=" in a or a.startswith(("+", "~"))) and not is_directory(a)]
    return [a for a in args if a not in overrides], overrides


def _overrides_only(command: str, args: list[str]) -> list[str]:
    words, overrides = _split(args)
    if words:
        raise UsageError(f"liftoff {command} takes only Hydra overrides (and -m for run/submit), got {words[0]!r}")
    return overrides


def _option(args: list[str], names: tuple[str, ...]) -> tuple[str | None, list[str]]:
    """The value of `--name VALUE` (or `--name=VALUE`) and the other args."""
    for i, a in enumerate(args):
        flag, eq, value = a.partition("=")
        if flag in names and eq:
            return value, args[:i] + args[i + 1 :]
        if a in names:
            if i + 1 == len(args):
                raise UsageError(f"{a} needs a value")
            return args[i + 1], args[:i] + args[i + 2 :]
    return None, args


def cmd_config(args: list[str]) -> int:
    """Print the composed, validated config (Hydra's `--cfg job`), or list the config groups.

    --cfg job         the composed config as YAML (the default; `hydra` and `all` are not kept)
    -p, --package K   only the part under K (`-p train`, `-p model.hidden_size`)
    --resolve         resolve ${...} interpolations before printing
    --info groups     each config group (a folder of conf/) with its options; * marks the default
    """
    info, args = _option(args, ("--info", "-i"))
    cfg_kind, args = _option(args, ("--cfg", "-c"))
    package, args = _option(args, ("--package", "-p"))
    resolve = "--resolve" in args
    overrides = _overrides_only("config", [a for a in args if a != "--resolve"])
    if info is not None:
        if info != "groups":
            raise UsageError(f"--info takes groups, got {info!r}")
        print_groups()
        return 0
    if cfg_kind not in (None, "job"):
        raise UsageError(f"--cfg takes job (the composed config), got {cfg_kind!r}: liftoff keeps no Hydra config")
    cfg = compose(overrides)
    part = OmegaConf.select(cfg, package, default=KeyError) if package else cfg
    if part is KeyError:
        raise UsageError(f"--package {package!r} names no part of the config")
    text = OmegaConf.to_yaml(part, resolve=resolve) if OmegaConf.is_config(part) else f"{part}\n"
    print(text, end="")
    return 0


def print_groups() -> None:
    """`GROUP  option, option*` for each folder of conf/; * is the option conf/config.yaml picks
    (Hydra's choice when composing without overrides)."""
    _, chosen = compose_choices()
    groups = config_groups()
    width = max(len(g) for g in groups)
    print("config groups (conf/GROUP/OPTION.yaml; choose one with GROUP=OPTION, * marks the default):")
    for group, options in groups.items():
        print(f"  {group:<{width}}  {', '.join(o + ('*' if chosen.get(group) == o else '') for o in options)}")


def cmd_artifacts(args: list[str]) -> int:
    """List, inspect and download the versions in the store (store.* overrides choose it).

    ls [KIND]                      every version (of one kind): ref, date, files, size, pinned
    show KIND/NAME[@VERSION]       one version: created, code version, pin, metadata, files,
                                   lineage; --json prints its raw manifest
    get KIND/NAME[@VERSION] [DEST] download it into DEST (default ./KIND-NAME-VERSION), checking
                                   every file's sha256, and print the folder
    rm KIND/NAME@VERSION           remove a version (every object, every S3 object version);
                                   refused when some lineage names it, unless --with-dependants,
                                   which removes those versions too; refused when one of them is
                                   pinned, unless --force; prints what it removed
    pin KIND/NAME@VERSION          keep a version from checkpoint retention and rm (unpin: no
                                   longer; unpinning a version that is not pinned is an error)

    VERSION: the version, any unique prefix of it (model/tiny@6aa3), or `latest` (the default
    for show and get); a run folder of `liftoff run` (runs/<experiment>/<date>_<time>...) stands
    for its model. A store that does not exist (store.root, or store.bucket for MinIO) is an
    error, exit 2.
    """
    from components.store import open_store
    from pipelines.artifacts import SUBCOMMANDS

    words, overrides = _split(args)
    if not words or words[0] not in SUBCOMMANDS:
        got = f", got {words[0]!r}" if words else ""
        raise UsageError(f"usage: {ARTIFACTS_USAGE}  [overrides]{got}")
    store = open_store(OmegaConf.to_object(compose(overrides).store), create=False)
    return SUBCOMMANDS[words[0]](store, words[1:])


def cmd_plan(args: list[str]) -> int:
    """Memory, FLOPs and step time for a config, no hardware needed; exit 1 when it cannot fit."""
    from components.preflight.plan import fits, reserved_gb, verdict
    from components.preflight.plan_config import as_overrides, plan_for, suggest, sync_skip
    from components.preflight.plan_format import (
        format_inputs,
        format_plan,
        format_suggestion,
        plan_warnings,
        seq_len_source,
    )

    searching = "--search" in args
    overrides = _overrides_only("plan", [a for a in args if a != "--search"])
    composed, choices = compose_choices(overrides)
    cfg = OmegaConf.to_object(composed)
    if searching:
        return _plan_search(cfg)
    p, device = plan_for(cfg)
    source, headroom = seq_len_source(overrides, choices), cfg.preflight.memory_headroom
    print(format_inputs(cfg, p, device, source))
    for warning in plan_warnings(cfg, source):
        print(f"warning: {warning}")
    print()
    print(format_plan(p, device.memory_gb, headroom))
    print(eval_line(cfg, p.params, device.memory_gb))
    reserved = reserved_gb(p, headroom)
    if fits(p, device.memory_gb, headroom):
        print(
            f"{verdict(p, device.memory_gb, headroom)}: {gib(reserved):.3f} of "
            f"{gib(device.memory_gb):.2f} GiB per device"
        )
        if (skip := sync_skip(cfg)) and p.step_time_s and skip[0].step_time_s < p.step_time_s:
            print(
                f"also fits: train.fsdp_sync_every_microbatch=false ({gib(skip[0].total_gb):.2f} GiB per device, "
                f"step {skip[0].step_time_s:.4g} s instead of {p.step_time_s:.4g} s: one reduce-scatter per step)"
            )
        return 0
    changes = suggest(cfg)
    print(f"suggestion: {format_suggestion(cfg, changes)}")
    hint = f"; nearest layout that fits: {' '.join(as_overrides(changes))}" if changes else "; nothing tried fits"
    print(
        f"liftoff plan: {verdict(p, device.memory_gb, headroom)}: {gib(reserved):.2f} GiB per device (with "
        f"preflight.memory_headroom={headroom}) > {gib(device.memory_gb):.2f} GiB{hint}",
        file=sys.stderr,
    )
    return 1


def eval_line(cfg, params: int, device_memory_gb: float) -> str:
    """Where validate and evaluate load the trained model, and whether it fits there."""
    from components.model_math import param_tensors
    from components.sharded_model import eval_plan

    model = dataclasses.replace(cfg.model, vocab_size=cfg.model.vocab_size or cfg.tokenizer.vocab_size)
    root = sum(n for kind, n, _ in param_tensors(model) if kind in ("embed", "head", "norm"))
    where, fits = eval_plan(cfg, params, root, device_memory_gb)
    return f"validate/evaluate: {where}" + ("" if fits else " (does not fit: more nodes, or a lower eval.batch_size)")


def _plan_search(cfg) -> int:
    """`liftoff plan --search`: the layouts that fit, fastest first, and the best as overrides."""
    from components.preflight.plan_config import as_overrides, suggest
    from components.preflight.plan_search import best_overrides, format_search, search

    found = search(cfg)
    print(format_search(cfg, found))
    if found:
        best = " ".join(best_overrides(found)) or "the config as it is"
        print(f"\nbest: {best}")
        return 0
    changes = suggest(cfg)
    hint = f"; fits with {' '.join(as_overrides(changes))}" if changes else "; nothing tried fits"
    print(f"liftoff plan --search: no layout fits on {cfg.cluster.nodes} node(s){hint}", file=sys.stderr)
    return 1


def cmd_profile(args: list[str]) -> int:
    """Trace N steps of a running training with torch.profiler on every rank; wait for the profile.

    RUN            the training: its identity (or a prefix), the train job's name (train-<8 hex>),
                   a run/ or model/ ref; omitted: the one training running in the store
    --steps N      steps to trace (default 3), from the next step the training looks for requests
                   (every train.profile_poll_steps steps)
    --timeout S    how long to wait for the published profile (default 600)

    Prints the `profile/MODEL@VERSION` ref: a Chrome trace per rank and summary.html (top ops,
    communication against compute, every rank side by side); `liftoff artifacts get REF` fetches it.
    """
    from components.store import open_store
    from pipelines.profile import profile

    steps, args = _option(args, ("--steps",))
    timeout, args = _option(args, ("--timeout",))
    words, overrides = _split(args)
    if len(words) > 1:
        raise UsageError(f"liftoff profile takes one RUN, got {' '.join(words)}")
    store = open_store(OmegaConf.to_object(compose(overrides).store), create=False)
    ref = profile(store, words[0] if words else None, int(steps or 3), float(timeout or 600))
    print(f"profile {ref}: liftoff artifacts get {ref}  (summary.html, rank<r>.pt.trace.json.gz)")
    return 0


def cmd_nodes(args: list[str]) -> int:
    """The nodes launches keep off: each quarantine record in the store (node, what found it,
    since when, how long it is left, why); store.* overrides choose the store.

    --clear NODE   remove NODE's record: the next launch may use it again
    --clear-all    remove every record
    """
    from components import fleet
    from components.store import open_store

    node, args = _option(args, ("--clear",))
    every = "--clear-all" in args
    store = open_store(
        OmegaConf.to_object(compose(_overrides_only("nodes", [a for a in args if a != "--clear-all"])).store),
        create=False,
    )
    if node is not None or every:
        gone = fleet.clear(store, None if every else [node])
        if node is not None and not gone:
            raise UsageError(f"no quarantine record for {node!r} (liftoff nodes lists them)")
        print("\n".join(f"cleared {n}" for n in gone) or "no records")
        return 0
    records = fleet.quarantined(store)
    print("\n".join(r.line() for r in records.values()) or "no node is quarantined")
    return 0


def cmd_compare(args: list[str]) -> int:
    """Runs side by side: config keys that differ, metrics with deltas against the first REF, and
    one HTML report with the tables and every run's curves overlaid.

    REF            a model/, eval/ or run/ version in the store (two or more); a model's newest
                   evaluation is used, an eval/ REF names its own. KIND/ may be left out (model),
                   VERSION may be a unique prefix or `latest` (model/tiny@6aa3, tiny@latest), and
                   a run folder of `liftoff run` (runs/<experiment>/<date>_<time>...) stands for
                   that run's own evaluation. Runtime-only train keys (ports, folders, logging,
                   checkpoint cadence) are not compared.
    --out PATH     where the report goes (default <train.run_dir>/compare/<date>_<time>.html)
    """
    import time

    from components.store import open_store
    from pipelines.compare import compare

    out, args = _option(args, ("--out", "-o"))
    refs, overrides = _split(args)
    cfg = compose(overrides)
    store = open_store(OmegaConf.to_object(cfg.store), create=False)
    path = Path(out) if out else Path(cfg.train.run_dir) / "compare" / f"{time.strftime('%Y-%m-%d_%H-%M-%S')}.html"
    for line in compare(store, refs, path):
        print(line)
    return 0


def _multirun(args: list[str]) -> tuple[bool, list[str]]:
    multi = "-m" in args or "--multirun" in args
    return multi, [a for a in args if a not in ("-m", "--multirun")]


def cmd_run(args: list[str]) -> int:
    """The whole DAG locally through kfp.local: a status line per stage, then where everything
    is; `-v` streams every process's log as well; `-m` sweeps and ends with a table."""
    from components.preflight.plan_config import plan_refusal
    from pipelines.local import (
        display_path,
        expand_sweep,
        missing_sources,
        mixture_refusal,
        multirun_folder,
        new_run_folder,
        run_local,
    )
    from pipelines.summary import summary_lines
    from pipelines.sweep import model_ref, model_refs, run_sweep, sweep_table, sweeper_of, without_hydra

    verbose = "-v" in args or "--verbose" in args
    multi, args = _multirun([a for a in args if a not in ("-v", "--verbose")])
    overrides = _overrides_only("run", args)
    if multi and sweeper_of(overrides) != "basic":  # hydra/sweeper=optuna: Hydra's multirun samples the trials
        return run_sweep(overrides, verbose)
    jobs = expand_sweep(without_hydra(overrides)) if multi else [overrides]
    composed = [compose_choices(job) for job in jobs]  # every job's config is checked before the first runs
    for cfg, _ in composed:  # and its plan: a model that cannot fit fails in seconds, before tokenize
        if refusal := plan_refusal(OmegaConf.to_object(cfg)):
            raise ConfigError(refusal)
        if missing := missing_sources(cfg):  # and its data: a file that is not there, before any stage
            raise ConfigError(missing)
        if refusal := mixture_refusal(cfg):  # a capped source that cannot feed its share, from its bytes
            raise ConfigError(refusal)
    sweep = multirun_folder() if multi else None
    rows = []
    for i, (job, (cfg, choices)) in enumerate(zip(jobs, composed, strict=True)):
        folder = new_run_folder(cfg, job, sweep / str(i) if sweep else None, choices)
        print(f"== {' '.join(['liftoff run', *job])}  ({display_path(folder)})", flush=True)
        known = model_refs(cfg)
        result = run_local(cfg, folder, verbose)
        for line in summary_lines(result):
            print(line)
        rows.append((job, result, model_ref(result) in known))
    if multi:
        table = sweep_table(rows)
        (sweep / "sweep.md").write_text("\n".join(table) + "\n")
        print("\n" + "\n".join(table))
    return 0


def cmd_compile(args: list[str]) -> int:
    from pipelines.cluster import BUILD, compile_pipeline

    overrides = _overrides_only("compile", args)
    path = compile_pipeline(compose(overrides), Path(BUILD) / "pretrain.yaml")
    print(f"compiled {path}")
    return 0


def cmd_render(args: list[str]) -> int:
    """What a cluster run would create: build/pretrain.yaml and build/jobs/{train,preflight}.yaml.

    Cluster configs only (cluster.scheduler=kubernetes: a preset such as experiment=h200-7b); the
    default, local config is refused in one line, exit 2 (`liftoff compile` writes its pipeline)."""
    from pipelines.cluster import render

    overrides = _overrides_only("render", args)
    for path in render(compose(overrides)):
        print(f"wrote {path}")
    return 0


def cmd_doctor(args: list[str]) -> int:
    """Check the live cluster and store the config names before anything is submitted: one row per
    check (name, ok / warn / FAIL, what was found, the fix), exit 0 when none fails; otherwise the
    table, one line on stderr naming the failing rows, exit 2.

    kfp backend               the backend's version (healthz, else the ml-pipeline Deployment's image)
                              against the oldest release the compiled pipeline runs on
    pod security              the namespace's pod-security.kubernetes.io/enforce level admits the
                              replica pods `render` builds (hostPath, capabilities, host network)
    volcano                   the queue cluster.queue exists and is Open
    gpu nodes                 enough nodes whose allocatable covers one replica's requests, on its
                              node selector (the GPU product) and past its tolerations
    store conditional writes  If-None-Match and If-Match behave on the bucket (the run lease needs them)
    store capacity            free space for train.checkpoint_keep checkpoints + 1 and the model
    image                     cluster.image's tag is this checkout's commit

    `submit` and `upload` run every check but KFP's first (--skip-doctor skips them)."""
    from pipelines.doctor import Unhealthy, failure_line, run_checks, table

    cfg = compose(_overrides_only("doctor", args))
    _refuse_local("doctor", cfg)
    rows = run_checks(cfg)
    print(table(rows))
    if any(r.failed for r in rows):
        raise Unhealthy(failure_line(rows))
    return 0


def _refuse_local(command: str, cfg) -> None:
    scheduler = getattr(cfg.cluster.scheduler, "value", cfg.cluster.scheduler)
    if scheduler != "kubernetes":
        raise ConfigError(
            f"{command} checks the cluster and store of a cluster run, and cluster.scheduler={scheduler} (this "
            f"machine) has none: name a cluster preset (liftoff {command} experiment=h200-7b kfp.host=URL)"
        )


def _skip_doctor(args: list[str]) -> tuple[bool, list[str]]:
    return "--skip-doctor" in args, [a for a in args if a != "--skip-doctor"]


def cmd_upload(args: list[str]) -> int:
    """Upload the pipeline to Kubeflow Pipelines: a new version named <commit>-<config hash>, a no-op
    when it exists. The doctor's checks (but KFP's) run first; --skip-doctor skips them."""
    from pipelines.cluster import upload

    skip, args = _skip_doctor(args)
    overrides = _overrides_only("upload", args)
    print(upload(compose(overrides), skip_doctor=skip))
    return 0


def cmd_submit(args: list[str]) -> int:
    """Submit to Kubeflow Pipelines; `--wait` follows every run and exits 1 unless all succeed.

    Every job's config is checked before the first is sent; for a cluster config the doctor's
    checks (but KFP's, which submit makes itself) run against the live cluster and store first.
    --skip-doctor skips them, and the run's name then ends ` (doctor skipped)`."""
    from pipelines.cluster import refuse_before_kfp, run_url, submit, sweep_name, wait
    from pipelines.local import expand_sweep
    from pipelines.sweep import submit_sweep, sweeper_of, without_hydra

    follow = "--wait" in args
    skip, args = _skip_doctor(args)
    multi, args = _multirun([a for a in args if a != "--wait"])
    overrides = _overrides_only("submit", args)
    if multi and sweeper_of(overrides) != "basic":  # each trial submitted, waited for, scored from the store
        return submit_sweep(overrides, skip_doctor=skip)
    jobs = expand_sweep(without_hydra(overrides)) if multi else [overrides]
    configs = [compose(job) for job in jobs]
    for cfg in configs:  # nothing is sent while one job would be refused
        refuse_before_kfp(cfg, skip)
    experiment = configs[0].kfp.experiment or sweep_name(overrides)
    runs = []
    for job, cfg in zip(jobs, configs, strict=True):
        run_id = submit(cfg, job, experiment, skip_doctor=skip, checked=True)
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
