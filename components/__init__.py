"""liftoff's pipeline stages and the shared floor they stand on (config schema, store, ...)."""

# The image a component declares: a placeholder. `on_cluster` in pipelines/pretrain.py sets
# every task's image from `cluster.image` (conf/cluster/*.yaml, the one source), so this
# name never reaches a pod.
STAGE_IMAGE = "liftoff-stage:set-from-cluster.image"


def _quiet_known_noise() -> None:
    """Library log records every process that imports torchao (directly or through
    transformers) would print, on every import, with nothing to act on: torchao's optional
    GPU kernels (mxfp8, CUTLASS sm90a) that this build does not ship, and torch's deprecation
    of the `register_constant` call torchao makes for its enums. Dropped at their loggers;
    everything else those loggers say still shows."""
    import logging

    def drop(logger: str, *fragments: str) -> None:
        logging.getLogger(logger).addFilter(lambda r: not any(f in str(r.msg) for f in fragments))

    drop("torchao", "_C_mxfp8", "_C_cutlass_90a")
    drop("torch.utils._pytree", "is an Enum subclass and is now natively supported by torch.compile")


_quiet_known_noise()
