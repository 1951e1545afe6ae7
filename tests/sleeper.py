"""A worker that only records its pid and waits: for tests of the launcher's lifecycle."""

import os
import sys
import time
from pathlib import Path

from components.launcher import decode_spec

if __name__ == "__main__":
    spec = decode_spec(sys.argv[sys.argv.index("--spec-b64") + 1])
    Path(spec["pid_dir"], f"{os.getpid()}.pid").write_text(str(os.getpid()))
    while True:
        time.sleep(1)
