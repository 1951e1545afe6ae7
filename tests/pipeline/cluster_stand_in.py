"""What the cluster does with a submitted run, on this machine: `python -m
tests.pipeline.cluster_stand_in PARAMS.json` runs the pipeline through kfp.local with the
parameters a `submit` sent to KFP (its group dicts over the composed defaults), against the store
they name. FakeKfp's executor starts it in a process of its own for each run created."""

from __future__ import annotations

import json
import sys

from omegaconf import OmegaConf

from components.config import compose
from pipelines.local import run_local


def main(path: str) -> int:
    parameters = json.loads(open(path).read())
    cfg = OmegaConf.merge(compose([]), parameters)  # the pipeline's defaults, then what the run was given
    run_local(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
