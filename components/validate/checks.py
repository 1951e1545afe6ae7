"""Checks on a trained model: file hashes, loading, finite forward pass, loss agreement."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from components.store import ArtifactStore, IntegrityError, Manifest, sha256_file

log = logging.getLogger(__name__)


class ValidationFailed(RuntimeError):
    """The model or checkpoint is not sound; the message names the file or check."""


@dataclass
class Verdict:
    checks: dict[str, bool] = field(default_factory=dict)
    numbers: dict[str, float] = field(default_factory=dict)

    def passed(self, name: str, **numbers: float) -> None:
        self.checks[name] = True
        self.numbers.update(numbers)
        log.info("validate: %s ok %s", name, numbers or "")


def verify_files(local: Path, manifest: Manifest) -> int:
    """Re-hash every file against the store manifest (not the fetch cache's word for it)."""
    for rel, entry in manifest.files.items():
        path = local / rel
        if not path.is_file():
            raise ValidationFailed(f"{rel}: missing from {manifest.ref}")
        if path.stat().st_size != entry["size"] or sha256_file(path) != entry["sha256"]:
            raise ValidationFailed(f"{rel}: sha256 does not match the manifest of {manifest.ref}")
    return len(manifest.files)


def fetch_verified_export(store: ArtifactStore, model: Manifest) -> Path:
    """The model's export, fetched and every file re-hashed. When its bytes do not match the
    manifest, the stored version is re-hashed too: a damaged stored version is quarantined, so
    it no longer exists and the next run's train stage publishes it again from its checkpoint
    (the same weights re-exported: the version heals) instead of handing the damaged one back."""
    try:
        local = store.fetch(model)
        verify_files(local, model)
        return local
    except (IntegrityError, ValidationFailed) as e:
        if not store.check(model.ref):  # the stored bytes verify: only this pod's copy was damaged
            raise ValidationFailed(str(e)) from None
        raise ValidationFailed(
            f"{model.ref} does not match its manifest in {store.description} ({e}); quarantined it: "
            "rerun to re-export it from its checkpoint (training again if that is damaged too)"
        ) from None


def load_checkpoint_weights(ckpt_dir: Path, hf_model, into: dict | None = None) -> dict[str, torch.Tensor]:
    """The model weights of a DCP checkpoint, read into `into` (tensors of the model's shapes)
    or a copy of the model's own state dict."""
    from components.checkpoint_format import load_state

    state = {"model": into if into is not None else {k: torch.empty_like(v) for k, v in hf_model.state_dict().items()}}
    try:
        load_state(state, ckpt_dir, no_dist=True)
    except Exception as e:
        raise ValidationFailed(f"{ckpt_dir}: the DCP checkpoint does not load into the model: {e}") from None
    return state["model"]


def weights_agree(verdict: Verdict, diffs: dict[str, float], ckpt_ref: str, model_ref: str) -> None:
    """checkpoint_matches_export: `diffs`, the max |diff| of each tensor that differs, is empty."""
    if diffs:
        raise ValidationFailed(
            f"checkpoint {ckpt_ref} and model {model_ref} weights differ in {len(diffs)} tensor(s) "
            f"(max |diff| per tensor: {dict(sorted(diffs.items())[:5])})"
        )
    verdict.passed("checkpoint_matches_export", checkpoint_max_abs_diff=0.0)


def losses_hold(verdict: Verdict, loss_of, val, data_ref: str, model: Manifest, cfg) -> None:
    """forward_finite and loss_agrees; `loss_of(n_blocks, batch_size)`: (the mean loss over the
    first val blocks, whether every logit was finite)."""
    if len(val) == 0:
        raise ValidationFailed(f"{data_ref}: the val split has zero blocks")
    val_loss, finite = loss_of(cfg.val_blocks, cfg.batch_size)
    if not finite or not math.isfinite(val_loss):
        raise ValidationFailed(f"forward pass: non-finite logits on the val split of {data_ref} (loss {val_loss})")
    verdict.passed("forward_finite", val_loss=val_loss)
    # the loss training measured on its live model (its wrappers, its precision) at the end, on
    # the first val blocks, recomputed here from the stored weights in fp32: a wrong export, a
    # stale artifact or lost weights cannot agree
    recorded, n = model.metadata.get("probe_loss"), model.metadata.get("probe_blocks", 0)
    if recorded is None or not isinstance(n, int) or n <= 0:
        raise ValidationFailed(f"{model.ref}: its manifest records no probe loss to check against")
    probe, _ = loss_of(n, min(n, cfg.batch_size))
    if not abs(probe - recorded) <= cfg.loss_tolerance:
        raise ValidationFailed(
            f"loss check: the stored model's loss on the first {n} val blocks is {probe:.4f}, training "
            f"recorded {recorded:.4f} for them; the gap exceeds eval.loss_tolerance={cfg.loss_tolerance}"
        )
    verdict.passed("loss_agrees", recorded_loss=recorded, loss_gap=abs(probe - recorded))


@torch.no_grad()
def mean_loss(model, blocks, n_blocks: int, batch_size: int) -> tuple[float, bool]:
    """Mean next-token loss over the first n_blocks val blocks; and whether all logits were finite."""
    from components.blocks import batches

    total, count, finite = 0.0, 0, True
    for batch in batches(blocks, n_blocks, batch_size):
        logits = model(input_ids=batch[:, :-1]).logits.float()
        finite &= bool(torch.isfinite(logits).all())
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
        total += float(loss)
        count += batch[:, 1:].numel()
    return (total / count if count else math.nan), finite
