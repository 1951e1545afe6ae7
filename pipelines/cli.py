"""`liftoff`: the command line. Each subcommand composes `conf/` with Hydra overrides;
`liftoff --help` lists the commands, `liftoff COMMAND --help` shows one. The commands
themselves are in `pipelines/commands.py`."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from pipelines.artifacts import USAGE as ARTIFACTS_USAGE
from pipelines.commands import (
    cmd_artifacts,
    cmd_compare,
    cmd_compile,
    cmd_config,
    cmd_doctor,
    cmd_nodes,
    cmd_plan,
    cmd_profile,
    cmd_render,
    cmd_run,
    cmd_submit,
    cmd_upload,
)


@dataclass(frozen=True)
class Command:
    run: Callable[[list[str]], int]
    usage: str  # after `liftoff `
    summary: str  # one line for `liftoff --help`

    def help(self) -> str:
        """`liftoff COMMAND --help`: usage, then the function's docstring."""
        lines = (self.run.__doc__ or self.summary).strip().splitlines()
        body = "\n".join([lines[0], *(ln[4:] if ln.startswith("    ") else ln for ln in lines[1:])])
        return f"usage: liftoff {self.usage}\n\n{body}\n\n{OVERRIDES_HELP}"


OVERRIDES_HELP = (
    "overrides are Hydra's: key=value (train.lr=1e-3), GROUP=OPTION (model=125m), +key=value inside a\n"
    "dict field, ~key; `liftoff config --info groups` lists the groups and their options."
)

COMMANDS: dict[str, Command] = {
    "config": Command(
        cmd_config,
        "config [--cfg job [-p KEY] [--resolve] | --info groups] [overrides]",
        "print the composed, validated config; --info groups lists the config groups and options",
    ),
    "run": Command(
        cmd_run, "run [-m] [overrides]", "the whole DAG locally through kfp.local; -m sweeps, ends with a table"
    ),
    "plan": Command(
        cmd_plan,
        "plan [--search] [overrides]",
        "memory / FLOPs / step-time plan, no hardware needed; exit 1 if it cannot fit; --search ranks layouts",
    ),
    "artifacts": Command(
        cmd_artifacts,
        f"{ARTIFACTS_USAGE.removeprefix('liftoff ')} [overrides]",
        "list, show and download (get) the versions in the store",
    ),
    "profile": Command(
        cmd_profile,
        "profile [RUN] [--steps N] [--timeout S] [overrides]",
        "trace N steps of a running training on every rank; the profile lands in the store",
    ),
    "nodes": Command(
        cmd_nodes,
        "nodes [--clear NODE | --clear-all] [overrides]",
        "the quarantined nodes launches keep off (why, until when); --clear lets one back",
    ),
    "compare": Command(
        cmd_compare,
        "compare REF REF... [--out PATH] [overrides]",
        "runs side by side: config diffs, metric deltas, curves overlaid in one HTML report",
    ),
    "compile": Command(
        cmd_compile,
        "compile [overrides]",
        "write the pipeline's IR YAML to build/pretrain.yaml, the config as defaults",
    ),
    "render": Command(
        cmd_render,
        "render [overrides]",
        "what a cluster run creates (cluster configs: experiment=h200-7b): build/pretrain.yaml, build/jobs/",
    ),
    "doctor": Command(
        cmd_doctor,
        "doctor [overrides]",
        "check the live cluster and store before submitting: one row per check, exit 2 when one fails",
    ),
    "upload": Command(
        cmd_upload,
        "upload [--skip-doctor] [overrides]",
        "upload the pipeline to Kubeflow Pipelines (a new version; no-op if unchanged)",
    ),
    "submit": Command(
        cmd_submit,
        "submit [-m] [--wait] [--skip-doctor] [overrides]",
        "runs on Kubeflow Pipelines (kfp.host), one per sweep job; --wait follows them",
    ),
}


def usage() -> str:
    """`liftoff --help`: every command, one line each."""
    width = max(len(name) for name in COMMANDS)
    rows = "\n".join(f"  {name:<{width}}  {c.summary}" for name, c in COMMANDS.items())
    return (
        "usage: liftoff COMMAND [args] [overrides]\n\ncommands:\n"
        f"{rows}\n\n`liftoff COMMAND --help` shows one command's usage.\n{OVERRIDES_HELP}"
    )


def main(argv: list[str] | None = None) -> int:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from components.store import StoreError
    from pipelines.cluster import KfpError
    from pipelines.doctor import Unhealthy
    from pipelines.interrupt import Interrupted
    from pipelines.local import RunFailed

    argv = list(sys.argv[1:] if argv is None else argv)
    _quiet_terminal()
    one_line = (HydraException, OmegaConfBaseException, ValueError, StoreError, KfpError, RunFailed, Unhealthy)
    try:
        return _dispatch(argv, one_line)
    except BrokenPipeError:  # `liftoff artifacts ls | head -1`: the reader left; so do we, quietly
        _silence_stdout()
        return 141  # what a shell reports for a process ended by SIGPIPE
    except Interrupted as e:  # every process of the run is gone already (pipelines/interrupt.py)
        print(f"liftoff: {e.line}", file=sys.stderr, flush=True)
        return 130


OWN_LOGGERS = ("components", "pipelines", "liftoff")


def _quiet_terminal() -> None:
    """What a person's terminal gets on stderr: liftoff's own one-line error (and the `warning:`
    lines it prints) and log records of ERROR and above from liftoff itself; not INFO records,
    a library's retries (urllib3's `Retrying`) or Python warnings (kfp.Client's FutureWarning),
    which become log records. `liftoff run` points the handler at the run's log for the run
    (pipelines/progress.py), which gets every record. A root logger configured already (a
    test's capture, a program calling `main`) is left as it is."""
    root = logging.getLogger()
    if root.handlers:
        return
    terminal = sys.stderr
    handler = logging.StreamHandler(terminal)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(
        lambda r: handler.stream is not terminal or (r.levelno >= logging.ERROR and r.name.split(".")[0] in OWN_LOGGERS)
    )
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)


def _dispatch(argv: list[str], one_line_errors: tuple[type[BaseException], ...]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        if len(argv) > 1 and argv[1] in COMMANDS:  # `liftoff help run`
            return _dispatch([argv[1], "--help"], one_line_errors)
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"liftoff: unknown command {argv[0]!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    if "-h" in argv[1:] or "--help" in argv[1:]:
        print(command.help())
        sys.stdout.flush()
        return 0
    try:
        rc = command.run(argv[1:])
        sys.stdout.flush()  # inside the try: a closed pipe shows here, not at exit
        return rc
    # ValueError covers ConfigError, UsageError and Hydra's own override errors
    except one_line_errors as e:
        print(f"liftoff {argv[0]}: {_one_line(e)}", file=sys.stderr)
        return 2


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's last flush cannot raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # a stdout without a file descriptor (captured)
        pass


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
