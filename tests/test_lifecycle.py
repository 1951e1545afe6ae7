"""The launched job never outlives its driver (finding 9): a driver stopped by SIGTERM, as
KFP and the kubelet stop a pod, cancels its job and every replica process ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DRIVER = """
import sys
from pathlib import Path
from components.config import defaults
from components.launcher import Launch, run_app
from tests.sleeper import SleeperSpec
cluster = defaults("cluster", nodes=2)
out = Path(sys.argv[1])
launch = Launch("tests.sleeper", SleeperSpec(str(out)), cluster, "sleeper", out / "logs", out / "nodes")
run_app(launch, {"PYTHONPATH": sys.argv[2]})  # the replicas' environment is only what is declared
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_sigterm_to_the_driver_cancels_its_job(tmp_path):
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path), str(ROOT)], cwd=ROOT)
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("*.pid"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    driver.send_signal(signal.SIGTERM)
    assert driver.wait(timeout=60) != 0
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [p for p in pids if _alive(p)], "replicas outlived their driver"
