"""liftoff's pipeline stages and the shared floor they stand on (config schema, store, ...)."""

# The image a component declares; every task's image is set from `cluster.image` when the
# pipeline is built (pipelines/pretrain.py), so this only names what `make images` builds.
STAGE_IMAGE = "ghcr.io/liftoff/liftoff:latest"
