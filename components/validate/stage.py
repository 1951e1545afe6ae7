"""The validate stage: every check must pass, or the run stops naming what failed."""

from __future__ import annotations

import logging
import math

import torch

from components.checkpoint_fetch import fetch_weights
from components.checkpoint_format import CheckpointError
from components.config import ClusterConfig, EvalConfig, StoreConfig
from components.hf import ModelLoadError, load_hf_model
from components.sharded_model import checkpoint_of, dataset_of, in_pod, launch_replicas
from components.store import ArtifactStore, IntegrityError, Ref, StoreError
from components.stream import open_split
from components.validate.checks import (
    ValidationFailed,
    Verdict,
    fetch_verified_export,
    load_checkpoint_weights,
    losses_hold,
    mean_loss,
    weights_agree,
)

log = logging.getLogger(__name__)


def run_validate(model_ref: str, eval_cfg: EvalConfig, store: ArtifactStore, cluster: ClusterConfig | None = None,
                 store_cfg: StoreConfig | None = None, pod_memory_gb: float = math.inf) -> Verdict:  # fmt: skip
    """In this pod, or on launched replicas when the model does not fit it (`eval.launch`)."""
    model_manifest = store.manifest(Ref.parse(model_ref))
    if not in_pod(eval_cfg, model_manifest, pod_memory_gb):
        if cluster is None or store_cfg is None:
            raise ValueError("validate on replicas needs the cluster and store groups")
        result = launch_replicas("components.validate.worker", "validate", eval_cfg, [model_ref], cluster, store_cfg,
                                 store)  # fmt: skip
        if "failed" in result:
            raise ValidationFailed(result["failed"])
        return Verdict(result["checks"], result["numbers"])
    return validate_in_pod(model_ref, model_manifest, eval_cfg, store)


def validate_in_pod(model_ref: str, model_manifest, eval_cfg: EvalConfig, store: ArtifactStore) -> Verdict:
    verdict = Verdict()
    model_dir = fetch_verified_export(store, model_manifest)
    verdict.passed("model_hashes", model_files=len(model_manifest.files))

    ckpt_ref, data_ref = checkpoint_of(model_manifest), dataset_of(model_manifest)
    if ckpt_ref is None or data_ref is None:
        raise ValidationFailed(f"{model_ref}: its lineage names no checkpoint or dataset ({model_manifest.parents})")
    try:
        model = load_hf_model(model_dir)
    except ModelLoadError as e:
        raise ValidationFailed(str(e)) from None
    verdict.passed("loads_with_transformers", parameters=sum(p.numel() for p in model.parameters()))

    # the checkpoint's weights only: its optimizer state (twice the weights under AdamW) is
    # never fetched; every byte read is verified against the checkpoint's index
    ckpt_manifest = store.manifest(Ref.parse(ckpt_ref))
    shapes = {k: torch.empty_like(v) for k, v in model.state_dict().items()}
    try:
        ckpt_dir, reads = fetch_weights(store, ckpt_manifest, store.cache_dir / ckpt_manifest.ref.prefix, shapes)
    except (CheckpointError, IntegrityError) as e:
        raise ValidationFailed(f"checkpoint {ckpt_ref}: {e}") from None
    except StoreError:
        raise  # the store failing is not the checkpoint's fault
    except (RuntimeError, ValueError, KeyError) as e:  # DCP's load planner: missing keys, other shapes
        raise ValidationFailed(f"checkpoint {ckpt_ref}: the DCP checkpoint does not load into the model: {e}") from None
    verdict.passed("checkpoint_hashes", checkpoint_weight_files=len(reads))
    weights = load_checkpoint_weights(ckpt_dir, model, into=shapes)  # two copies in the pod: POD_COPIES
    exported = model.state_dict()
    # exact, per tensor: torch.equal is False for a NaN, which `diff > 0` and Python's max would drop
    differ = sorted(k for k in exported if not torch.equal(weights[k], exported[k]))
    weights_agree(verdict, {k: float((weights[k].float() - exported[k].float()).abs().max()) for k in differ},
                  ckpt_ref, model_ref)  # fmt: skip
    val = open_split(store, store.manifest(Ref.parse(data_ref)), "val")
    losses_hold(verdict, lambda n, size: mean_loss(model, val, n, size), val, data_ref, model_manifest, eval_cfg)
    return verdict
