"""liftoff's pipeline stages and the shared floor they stand on (config schema, store, ...)."""

# The image a component declares: a placeholder. `on_cluster` in pipelines/pretrain.py sets
# every task's image from `cluster.image` (conf/cluster/*.yaml, the one source), so this
# name never reaches a pod.
STAGE_IMAGE = "liftoff-stage:set-from-cluster.image"
