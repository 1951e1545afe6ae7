"""liftoff's pipeline stages and the pieces they share (config schema, artifact store)."""

import os

# The stage image every KFP component runs in: it has kfp, torch and this package, so
# nothing is pip-installed at run time. `make images` builds it; override to use another.
STAGE_IMAGE = os.environ.get("LIFTOFF_IMAGE", "ghcr.io/liftoff/liftoff:latest")
