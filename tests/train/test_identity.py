"""The training identity: what makes two runs the same training (one lease, one set of
checkpoints that `resume=auto` continues) and what makes them different ones. Asserted on the
identity itself and on what a sweep finds in a store, for each setting of TrainConfig."""

from __future__ import annotations

import dataclasses
from enum import Enum

import pytest
from omegaconf import OmegaConf

from components.config import as_plain_dict, compose, defaults
from components.evaluate.stage import eval_suffix
from components.identity import training_identity

DATASET = "dataset/kjv@0123456789ab"

# Every setting that changes the optimisation trajectory (the weights a step produces from the
# ones before it, or which steps are taken): two runs differing in any one must never share
# checkpoints, so each is part of the identity. Listed here, not derived from NOT_IDENTITY.
TRAJECTORY = {
    "steps": 1001,  # the cosine's length: every lr after warmup moves
    "lr": 6e-4,
    "warmup_steps": 4,
    "min_lr": 1e-6,
    "weight_decay": 0.0,
    "beta1": 0.8,
    "beta2": 0.999,
    "grad_clip": 0.5,
    "seed": 1234,
    "micro_batch_size": 4,
    "grad_accum_steps": 2,
    "precision": "bf16",
    "fp8_recipe": "rowwise",
    "loss_scaling": True,
    "parallelism": "fsdp",
}

# Settings that do not: where and how often things are written, logged and checked, the
# layout a checkpoint reshards across. A run differing only in these continues the same training.
BOOKKEEPING = {
    "checkpoint_dir": "/mnt/nvme/ckpt",
    "checkpoint_interval": 7,
    "checkpoint_keep": 9,
    "checkpoint_async": False,
    "checkpoint_block_kib": 1024,
    "resume": "never",
    "run_dir": "/elsewhere/runs",
    "log_interval": 3,
    "val_interval": 0,
    "on_nonfinite": "halt",
    "max_bad_steps": 7,
    "on_spike": "skip",
    "loss_spike_factor": 9.0,
    "max_spikes": 4,
    "sdc_interval": 0,
    "straggler_interval": 13,
    "straggler_zscore": 2.5,
    "watchdog_timeout_s": 30.0,
    "peak_tflops": 989.0,
    "compile": True,
    "fsdp_sync_every_microbatch": False,
    "dp_replicate": 2,
    "tp": 2,
    "sequence_parallel": False,
    "async_tp": True,
    "loss_chunk_tokens": 512,
    "pp": 2,
    "pp_schedule": "gpipe",
    "activation_checkpointing": "full",
    "ac_every_n_blocks": 2,
    "metrics_port": 9400,
    "profile_poll_steps": 50,
}


def base():
    return defaults("train", resume="auto")


def with_value(train, key: str, value):
    current = getattr(train, key)
    if isinstance(current, Enum):
        value = type(current)(value)
    changed = dataclasses.replace(train, **{key: value})
    assert as_plain_dict(changed)[key] != as_plain_dict(train)[key], f"{key}: the variant must differ"
    return changed


def ident(train, model=None, dataset: str = DATASET) -> str:
    return training_identity(dataset, model or defaults("model"), train)


def test_every_train_setting_is_classified():
    """A new TrainConfig field must be put on one side on purpose (here and in NOT_IDENTITY)."""
    fields = {f.name for f in dataclasses.fields(base())}
    assert set(TRAJECTORY) | set(BOOKKEEPING) == fields
    assert not set(TRAJECTORY) & set(BOOKKEEPING)


@pytest.mark.parametrize("key", sorted(TRAJECTORY))
def test_a_trajectory_setting_is_a_new_training_identity(key):
    train = base()
    assert ident(with_value(train, key, TRAJECTORY[key])) != ident(train)


@pytest.mark.parametrize("key", sorted(BOOKKEEPING))
def test_a_bookkeeping_setting_keeps_the_training_identity(key):
    train = base()
    assert ident(with_value(train, key, BOOKKEEPING[key])) == ident(train)


def test_a_sweep_over_warmup_or_min_lr_gives_each_job_its_own_identity():
    """`train.warmup_steps=2,4` (or min_lr): each job its own identity, so neither resumes the other's checkpoints."""
    for key, values in {"warmup_steps": (2, 4), "min_lr": (0.0, 3e-5), "seed": (0, 1)}.items():
        ids = {ident(dataclasses.replace(base(), **{key: v})) for v in values}
        assert len(ids) == len(values), key


def test_a_named_seed_checkpoint_is_part_of_the_identity():
    """`train.resume=<version>` continues that checkpoint's trajectory: a run seeded from it is not
    the run from scratch (auto/never), nor one seeded from another version."""
    auto = ident(base())
    seeded = {ident(dataclasses.replace(base(), resume=v)) for v in ("abc-step12-0a", "abc-step16-0b")}
    assert len(seeded) == 2 and auto not in seeded


def test_the_dataset_and_the_model_are_part_of_the_identity():
    train = base()
    assert ident(train, dataset="dataset/kjv@ffffffffffff") != ident(train)
    assert ident(train, model=defaults("model", hidden_size=32)) != ident(train)


def publish(store, tmp, kind: str, name: str, version: str, parents=(), metadata=None):
    src = tmp / f"{kind}-{version}"
    src.mkdir(parents=True)
    (src / "out.json").write_text("{}")
    return store.publish(kind, name, version, src, metadata=metadata, parents=list(parents)).ref


@pytest.mark.parametrize("key,wanted,other", [("warmup_steps", 2, 4), ("min_lr", 1e-5, 3e-5)])
def test_a_sweep_reads_the_eval_of_its_own_trial_not_one_differing_in_warmup_or_min_lr(tmp_path, key, wanted, other):
    """A finished cluster trial's eval is found by the trial's train settings: the newer eval of
    a model trained with another warmup (or min_lr) is not this trial's result."""
    from components.store import open_store
    from pipelines.sweep import submitted_eval

    store = open_store(defaults("store", root=str(tmp_path / "store"), cache_dir=str(tmp_path / "cache")))
    cfg = compose([f"train.{key}={wanted}"])
    typed = OmegaConf.to_object(cfg)
    suffix = eval_suffix(typed.eval)
    refs = {}
    for i, value in enumerate((wanted, other)):  # the other trial's eval is the newer one
        train = as_plain_dict(dataclasses.replace(typed.train, **{key: value}))
        model = publish(store, tmp_path, "model", typed.model.name, f"m{i}", metadata={"train": train})
        refs[value] = publish(store, tmp_path, "eval", typed.model.name, f"m{i}-{suffix}", [str(model)])
    assert submitted_eval(store, cfg, since=0.0) == str(refs[wanted])


def test_a_llama_keeps_the_identity_it_had_before_model_family_existed():
    """The mixture-of-experts keys (model.family and its experts) joined the model config after
    Llama runs were stored: a Llama's identity leaves their defaults out, so `resume=auto` still
    finds those runs (the value below was computed by the code before the keys existed); a
    mixture of experts is an identity of its own."""
    from components.config import defaults
    from components.identity import training_identity

    assert training_identity("dataset/kjv@abc", defaults("model"), defaults("train")) == "72c464bf3ea9dc5a"
    moe = defaults("model", family="moe", num_experts=4, experts_per_token=2)
    assert training_identity("dataset/kjv@abc", moe, defaults("train")) != "72c464bf3ea9dc5a"
