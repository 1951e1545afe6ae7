"""A training's identity: the hash of what decides its trajectory (dataset, model, the train
settings that change the optimisation), which names its run directory and its checkpoints, and
which `train.resume=auto` continues. In the floor: train names its run by it, preflight skips a
run already trained to its end, the CLI and compare read what is not in it."""

from __future__ import annotations

import hashlib
import json
import logging

from components.config import ModelConfig, TrainConfig, as_plain_dict, drop_none
from components.store import ArtifactStore, Ref, StoreError

log = logging.getLogger(__name__)

# Train settings that do not change the optimisation trajectory: a run differing only in these
# continues the same training (same checkpoints); anything else (steps, warmup, lr, min_lr, the
# schedule, the seed, the batch, precision...) is a new training identity, so `resume=auto`
# never continues another schedule's checkpoint. Continuing another run is explicit
# (`train.resume=<version>`), and the seed is then part of the identity. The world size is not
# in it: DCP reshards the checkpoint and the sample order does not depend on it.
NOT_IDENTITY = {
    "checkpoint_dir",
    "checkpoint_interval",
    "checkpoint_keep",
    "checkpoint_async",
    "checkpoint_block_kib",
    "resume",
    "run_dir",
    "log_interval",
    "val_interval",
    "on_nonfinite",
    "max_bad_steps",
    "on_spike",
    "loss_spike_factor",
    "max_spikes",
    "sdc_interval",
    "straggler_interval",
    "straggler_zscore",
    "watchdog_timeout_s",
    "peak_tflops",
    "compile",
    "fsdp_sync_every_microbatch",  # the reduction order, as the world size: rounding, not the math
    "dp_replicate",  # HSDP's layout, as the world size
    "tp",  # tensor parallelism's layout: DCP reshards its checkpoints into any other
    "sequence_parallel",  # how tp splits activations: rounding, not the math; the same parameter names
    "async_tp",  # when tp's collectives run beside the matmuls: the same math
    "loss_chunk_tokens",  # the loss's memory: the same cross-entropy, summed in chunks
    "pp",  # pipeline parallelism's layout, as tp: a stage saves the full model's names
    "pp_schedule",  # the order micro-batches run in: the same averaged gradient
    "activation_checkpointing",
    "ac_every_n_blocks",
    "metrics_port",
    "profile_poll_steps",
}


# what `model.family` brought (the mixture of experts): a Llama's are the defaults, left out so
# every Llama run keeps the identity it had before the key existed
_FAMILY_KEYS = {"family": "llama", "num_experts": 0, "experts_per_token": 0, "router_aux_loss_coef": 0.0}


def model_identity(model: ModelConfig) -> dict:
    plain = drop_none(as_plain_dict(model))
    llama = model.family == "llama"
    return {k: v for k, v in plain.items() if not (llama and k in _FAMILY_KEYS and v == _FAMILY_KEYS[k])}


def training_identity(dataset: str, model: ModelConfig, train: TrainConfig, mixture: dict | None = None) -> str:
    """`mixture`: a mixture's weights and caps (`mixture_identity`); none for one source."""
    math = {k: v for k, v in as_plain_dict(train).items() if k not in NOT_IDENTITY}
    if train.resume not in ("auto", "never"):  # a seeded run continues that checkpoint's trajectory
        math["seed_checkpoint"] = train.resume
    ident = {"dataset": dataset, "model": model_identity(model), "train": math}
    if mixture:  # a dataset of one source keeps the identity it had before mixtures
        ident["mixture"] = mixture
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def mixture_identity(weights: dict, caps: dict) -> dict:
    """What of a mixture decides the samples: the weights (rounded: 0.1+0.2 is 0.3) and caps."""
    return {"weights": {k: round(v, 12) for k, v in weights.items()}, "max_epochs": caps} if weights else {}


def trained_to_the_end(
    dataset: str, model: ModelConfig, train: TrainConfig, store: ArtifactStore, mixture: dict | None = None
) -> str | None:
    """The stored checkpoint at train.steps that `train.resume=auto` would continue from, all its
    objects there at their sizes: a run that resumes there trains no step (preflight skips)."""
    from components.checkpoint_fetch import step_of_manifest

    if train.resume != "auto":
        return None
    try:
        identity = training_identity(str(store.resolve(*_parts(dataset)).ref), model, train, mixture)
        for m in store.versions("checkpoint", model.name):
            if m.metadata.get("identity") == identity and step_of_manifest(m) == train.steps:
                if not store.size_problems(m):
                    return str(m.ref)
    except StoreError as e:  # preflight then measures: no skip on a doubt
        log.warning("preflight: could not look for a finished checkpoint: %s", e)
    return None


def _parts(ref: str) -> tuple[str, str, str]:
    r = Ref.parse(ref)
    return r.kind, r.name, r.version
