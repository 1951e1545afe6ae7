"""What `liftoff run` prints when one replica fails first and its peer then loses the
connection (issue 21, acceptance 5): the one stderr line names the first failure, rank 1's
NotFound, and calls rank 0's lost connection a consequence."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.conftest import ROOT
from tests.faults import RAISED_VERSION, fault_env
from tests.pipeline.test_local_run import FAST
from tests.pipeline.test_run_output import one_error_line


def test_liftoff_run_names_the_replica_that_failed_first(tmp_path):
    env = {**os.environ, **fault_env(raise_rank=1, raise_step=3), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "pipelines.cli", "run", *FAST, "cluster.max_restarts=0", "train.resume=never"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    err = one_error_line(proc)
    first, _, after = err.partition(" (replica 0 rank 0 failed after it: ")
    head = r"stage train failed: LaunchError: train-\w{8} ended FAILED; first failure: replica 1 rank 1 at [\d:.]+: "
    cause = re.escape(f"NotFound: no version {RAISED_VERSION} of checkpoint/tiny in the store")
    assert re.search(head + cause + "$", first), err
    assert after, err  # rank 0's own error, named as what followed
    assert "Connection closed" not in first and "RendezvousConnectionError" not in first
