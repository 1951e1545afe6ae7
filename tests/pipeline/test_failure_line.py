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
from tests.helpers import FAST, one_error_line


def test_liftoff_run_names_the_replica_that_failed_first(tmp_path):
    env = {**os.environ, **fault_env(raise_rank=1, raise_step=3), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "pipelines.cli", "run", *FAST, "cluster.max_restarts=0", "train.resume=never"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    err = one_error_line(proc)
    head = r"stage train failed: LaunchError: train-\w{8} ended FAILED; first failure: replica 1 rank 1 at [\d:.]+: "
    cause = re.escape(f"NotFound: no version {RAISED_VERSION} of checkpoint/tiny in the store")
    # replica 0 then either logs its own error (its peer gone) or is killed by its agent before it
    # can: either way it is named as what followed, never as the cause
    followed = r"( \(replica 0 rank 0 failed after it: .+\)|; replica 0 logged no error \(.+\))"
    assert re.search(head + cause + followed + r" \(full log: ", err), err
    cause_part = err.split("; first failure: ", 1)[1].split(" (replica 0", 1)[0].split("; replica 0", 1)[0]
    assert "Connection closed" not in cause_part and "RendezvousConnectionError" not in cause_part
