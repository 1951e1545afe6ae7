"""A KFP task's process ends without the interpreter's module teardown only once its outputs are
written and nothing raised (components/task.py `exit_once_written`): a failure keeps its exit code,
and the exit handlers run in every case."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

SCRIPT = """
import atexit, json, sys
from pathlib import Path
from components.task import exit_once_written
atexit.register(lambda: Path(sys.argv[3] + ".handler").write_text("ran"))  # an exit handler: always runs


class Finalized:  # finalized with the module's globals: only in the interpreter's own teardown
    def __del__(self, open=open, path=sys.argv[3]):
        open(path, "w").write("teardown ran")


kept = Finalized()
exit_once_written()
if sys.argv[4] in ("written", "raises"):
    Path(json.loads(sys.argv[2])["outputs"]["outputFile"]).write_text("{}")
if sys.argv[4] == "raises":
    raise RuntimeError("the executor failed after the task")
"""


@pytest.mark.parametrize(
    ("case", "code", "teardown"),
    [("written", 0, False), ("raises", 1, True), ("not-written", 0, True)],
)
def test_a_task_skips_the_teardown_only_when_its_outputs_are_written_and_nothing_raised(tmp_path, case, code, teardown):
    output, marker = tmp_path / "executor_output.json", tmp_path / "teardown"
    executor_input = json.dumps({"outputs": {"outputFile": str(output)}})
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, "--executor_input", executor_input, str(marker), case],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    # argv[1:] of `-c` is the rest: --executor_input, its JSON, the marker, the case
    assert proc.returncode == code, proc.stderr
    assert marker.exists() is teardown, (case, proc.stderr)
    assert (tmp_path / "teardown.handler").read_text() == "ran"  # exit handlers run either way
    assert ("the executor failed after the task" in proc.stderr) is (case == "raises")
