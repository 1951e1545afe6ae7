"""A pod, simulated on this machine: how a local TorchX replica ("node") starts.

`python -m components.local_pod --dir DIR --declared K1,K2 [--secret FILE] -- CMD ...`
runs CMD with DIR as working directory, HOME and TMPDIR, and with exactly the environment
its Kubernetes spec would declare: the declared names (from the same `build_app` that
writes the Volcano job), what the scheduler itself sets (TorchX's and torchrun's
variables, PATH) and the store's keys read from a Secret file, as `secretKeyRef` would put
them. Nothing the driver happens to have in its environment leaks through, and nothing on
the driver's disk is reachable by a relative path: a boundary bug fails here first.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import tempfile
import uuid
from pathlib import Path

from components.k8s import STORE_SECRET_KEYS

# what TorchX's local scheduler and torchrun put into a replica's environment themselves,
# as the Kubernetes scheduler and the kubelet do in a pod
SCHEDULER_PREFIXES = ("TORCHX_", "TORCHELASTIC_", "PET_")
SCHEDULER_NAMES = ("PATH", "PYTHONUNBUFFERED", "CUDA_VISIBLE_DEVICES")


TASK_ROOT_ENV = "LIFTOFF_LOCAL_TASK_ROOT"  # set by `liftoff run` for the KFP tasks it starts


def enter_task_directory(stage: str) -> Path | None:
    """Under `liftoff run`, give this KFP task a directory of its own (cwd, HOME, TMPDIR), as its
    pod would have its own disk: a relative path or a cache written by one stage is not there
    for the next. On a cluster the pod already is that, and this does nothing."""
    root = os.environ.get(TASK_ROOT_ENV)
    if not root:
        return None
    task_dir = Path(root).resolve() / f"{stage}-{uuid.uuid4().hex[:8]}"
    (task_dir / "tmp").mkdir(parents=True)
    os.environ.update(HOME=str(task_dir), TMPDIR=str(task_dir / "tmp"))
    tempfile.tempdir = None  # re-read TMPDIR
    os.chdir(task_dir)
    return task_dir


def write_secret(path: Path, values: dict[str, str]) -> Path:
    """A Secret's data as a file only its owner can read (the local stand-in for a Secret)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, stat.S_IRUSR | stat.S_IWUSR)
    with os.fdopen(fd, "w") as f:
        json.dump(values, f)
    return path


def store_secret_values(environ: dict[str, str]) -> dict[str, str]:
    """The store Secret's data (key -> value) from the driver's own environment."""
    return {key: environ[name] for name, key in STORE_SECRET_KEYS.items() if environ.get(name)}


def pod_env(inherited: dict[str, str], declared: list[str], secret: dict[str, str], node_dir: Path) -> dict[str, str]:
    scheduler = [k for k in inherited if k in SCHEDULER_NAMES or k.startswith(SCHEDULER_PREFIXES)]
    env = {k: inherited[k] for k in [*declared, *scheduler] if k in inherited}
    env.update({name: secret[key] for name, key in STORE_SECRET_KEYS.items() if key in secret})
    env.update(HOME=str(node_dir), TMPDIR=str(node_dir / "tmp"))
    return env


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="components.local_pod")
    parser.add_argument("--dir", required=True)
    parser.add_argument("--declared", default="")
    parser.add_argument("--secret", default="")
    args = parser.parse_args(argv[:split])
    command = argv[split + 1 :]
    node_dir = Path(args.dir).resolve()
    (node_dir / "tmp").mkdir(parents=True, exist_ok=True)
    secret = json.loads(Path(args.secret).read_text()) if args.secret else {}
    env = pod_env(dict(os.environ), [k for k in args.declared.split(",") if k], secret, node_dir)
    os.chdir(node_dir)
    os.execvpe(command[0], command, env)


if __name__ == "__main__":
    main()
