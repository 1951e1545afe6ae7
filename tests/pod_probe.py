"""A worker that records what its "pod" looks like (directory, environment) and exits."""

import json
import os
import sys
from pathlib import Path

from components.launcher import decode_spec

if __name__ == "__main__":
    spec = decode_spec(sys.argv[sys.argv.index("--spec-b64") + 1])
    seen = {"cwd": os.getcwd(), "env": dict(os.environ), "driver_dir_visible": Path(spec["driver_file"]).exists()}
    Path(f"pod-{os.environ['RANK']}.json").write_text(json.dumps(seen))
