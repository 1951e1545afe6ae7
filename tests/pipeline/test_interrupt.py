"""A stop stops everything: SIGINT to the `liftoff run` process alone, mid-train, ends every
process of the run, publishes nothing afterwards, says one line and exits 130; a rerun resumes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from components.config import defaults
from components.store import open_store
from pipelines.interrupt import descendants
from tests.conftest import ROOT
from tests.faults import fault_env
from tests.helpers import FAST

RUN = [*(o for o in FAST if not o.startswith("train.steps=")), "train.steps=20", "train.log_interval=1"]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _mentioning(text: str) -> list[int]:
    """Live processes whose command line or working directory names `text`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(f"/proc/{entry}/cwd")
        except OSError:
            continue
        if (text in cmdline or cwd.startswith(text)) and _alive(int(entry)):
            found.append(int(entry))
    return found


def _stored(store) -> dict[str, str]:
    """ref -> created time of every version in the store."""
    return {str(m.ref): m.created for m in store.ls()}


@pytest.mark.chaos_slow  # 54 s, a run, SIGINT and its rerun: in `make chaos`
def test_sigint_to_the_cli_alone_stops_every_process_and_a_rerun_resumes(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), **fault_env(slow_rank=0, slow_seconds=0.05)}
    cmd = [sys.executable, "-m", "pipelines.cli", "run", *RUN]
    store = open_store(defaults("store", root=str(tmp_path / "artifacts"), cache_dir=str(tmp_path / "probe")))
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and proc.poll() is None:  # until a checkpoint is in the store
            if tmp_path.joinpath("artifacts", "checkpoint").is_dir() and list(store.ls("checkpoint")):
                break
            time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()
        tree = descendants(proc.pid)
        assert len(tree) >= 4  # the KFP task, the torchrun agents and workers
        before = _stored(store)
        signalled = time.time()
        proc.send_signal(signal.SIGINT)  # the process alone, not its group
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    # within 10 s of the signal every process of the run is gone (and so nothing can publish later)
    while time.time() < signalled + 10 and ([p for p in tree if _alive(p)] or _mentioning(str(tmp_path))):
        time.sleep(0.2)
    assert [p for p in tree if _alive(p)] == [] and _mentioning(str(tmp_path)) == []
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    m = re.fullmatch(
        r"liftoff: interrupted during train \(step (\d+)\); a rerun resumes from (checkpoint/tiny@\S+)",
        line,
    )
    assert m, err[-3000:]
    after = _stored(store)
    new = {ref for ref, created in after.items() if ref not in before}
    late = [ref for ref in new if created_after(after[ref], signalled)]
    assert late == []  # nothing was published after the signal
    assert m.group(2) in after

    rerun = subprocess.run(
        cmd, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600
    )
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    models = list(store.ls("model"))
    assert len(models) == 1 and models[0].metadata["continued"].startswith(f"resumed from {m.group(2)}")
    assert models[0].metadata["steps"] == 20


def created_after(created: str, t: float) -> bool:
    from datetime import datetime

    return datetime.fromisoformat(created).timestamp() > t


# the CLI's side of a stop (pipelines/local.py's `stopped_by_signals`), around a process that
# leaves an orphan, as TorchX leaves its replicas: a child that starts one in a session of its
# own and exits
ORPHANING = """
import subprocess, sys, time
from pipelines.interrupt import Interrupted, stopped_by_signals
try:
    with stopped_by_signals(lambda: "stopped"):
        subprocess.run(["sh", "-c", 'sleep 300 & echo $! > "$0"', sys.argv[1]], check=True, start_new_session=True)
        print("orphaned", flush=True)
        while True:
            time.sleep(1)
except Interrupted:
    sys.exit(130)
"""


def test_an_orphan_of_the_run_is_stopped_with_it(tmp_path):
    pid_file = tmp_path / "orphan.pid"
    cmd = [sys.executable, "-c", ORPHANING, str(pid_file)]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
    orphan = None
    try:
        assert proc.stdout.readline().strip() == "orphaned", proc.communicate()
        orphan = int(pid_file.read_text())
        assert _alive(orphan)
        proc.send_signal(signal.SIGINT)  # the process alone, as in the test above
        assert proc.wait(timeout=30) == 130
        assert not _alive(orphan)  # its parent was gone before the stop: the CLI stopped it all the same
    finally:
        if proc.poll() is None:
            proc.kill()
        if orphan is not None and _alive(orphan):
            os.kill(orphan, signal.SIGKILL)
