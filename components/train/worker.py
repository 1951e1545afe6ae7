"""The training process torchrun starts on every rank: `python -m components.train.worker --spec-b64 ...`.

The loop reads top to bottom: batch -> forward/backward per micro-batch -> agree on the loss
across ranks -> unscale, clip, step (or skip a non-finite step) -> log -> checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from components.config import ModelConfig, Precision, StoreConfig, TrainConfig, group_from_dict
from components.launcher import decode_spec
from components.store import Ref, open_store
from components.tokenize.blocks import load_stats, open_token_blocks
from components.train import checkpoint as ckpt
from components.train.activation_checkpoint import apply_activation_checkpointing
from components.train.data import BlockSampler
from components.train.export import export_hf
from components.train.model import build_model, count_params, flops_per_token
from components.train.monitor import Monitor, Watchdog, mfu, peak_memory_bytes
from components.train.nonfinite import first_nonfinite_module
from components.train.optim import build_optimizer, clip_and_step, lr_at, set_lr
from components.train.parallel import init_distributed, unwrap, wrap
from components.train.precision import apply_fp8, autocast
from components.train.resume import find_resume_checkpoint

log = logging.getLogger("liftoff.train")


def inject_faults(model: torch.nn.Module, faults, rank: int, state: dict) -> None:
    """Test-only faults (train.faults); inert with the defaults."""
    if faults.nan_steps:

        def poison(module, args, output):
            return output * float("nan") if state["step"] in faults.nan_steps else output

        model.get_input_embeddings().register_forward_hook(poison)
    if rank == faults.slow_rank:  # a slow device: every forward pass takes longer
        model.register_forward_pre_hook(lambda module, args: time.sleep(faults.slow_seconds))


def fault_tick(faults, rank: int, step: int) -> None:
    if rank == faults.hang_rank and step == faults.hang_step:
        log.warning("fault injection: rank %d hangs at step %d", rank, step)
        while True:
            time.sleep(3600)
    first_attempt = os.environ.get("LIFTOFF_ATTEMPT", "0") == "0"
    if rank == faults.kill_rank and step == faults.kill_step and first_attempt:
        log.warning("fault injection: rank %d SIGKILLs itself at step %d", rank, step)
        os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec-b64", required=True)
    spec = decode_spec(parser.parse_args(argv).spec_b64)
    tcfg: TrainConfig = group_from_dict(TrainConfig, spec["train"])
    mcfg: ModelConfig = group_from_dict(ModelConfig, spec["model"])
    store = open_store(group_from_dict(StoreConfig, spec["store"]))
    run_dir = Path(spec["run_dir"])
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s rank{os.environ.get('RANK', '?')} %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout,
    )
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    watchdog = Watchdog(tcfg.watchdog_timeout_s)
    watchdog.start()
    rank, world, device = init_distributed(timeout_s=max(60.0, tcfg.watchdog_timeout_s * 2))

    # data and model
    dataset_ref = Ref.parse(spec["dataset"])
    data_dir = store.fetch(store.manifest(dataset_ref))
    blocks = open_token_blocks(data_dir, "train")
    vocab = load_stats(data_dir)["vocab_size"]
    sampler = BlockSampler(blocks, tcfg.micro_batch_size, tcfg.grad_accum_steps, world, rank, tcfg.seed)
    model = build_model(mcfg, mcfg.vocab_size or vocab, tcfg.seed).to(device)
    seq_len = blocks.block_len - 1
    n_flops = flops_per_token(mcfg, count_params(model, exclude_embeddings=True), seq_len)
    if tcfg.precision == Precision.fp8:
        apply_fp8(model, tcfg, device)
    if tcfg.activation_checkpointing:
        n = apply_activation_checkpointing(model, tcfg.ac_every_n_blocks)
        log.info("activation checkpointing on %d of %d blocks", n, mcfg.num_layers)
    state = {"step": 0}
    inject_faults(model, tcfg.faults, rank, state)
    model = wrap(model, tcfg.parallelism, device)
    optimizer = build_optimizer(model, tcfg)
    scaler = torch.amp.GradScaler(device.type) if tcfg.loss_scaling else None

    # checkpoints: resume, then save every interval, publish each to the store in the background
    ckpt_root = Path(spec["checkpoint_dir"])
    publisher = None
    if rank == 0:

        def publish(path: Path, meta: dict) -> None:
            store.publish(
                "checkpoint",
                mcfg.name,
                f"{spec['identity']}-step{meta['step']}",
                path,
                metadata=meta,
                parents=[spec["dataset"]],
            )

        publisher = ckpt.BackgroundPublisher(publish)
    checkpointer = ckpt.Checkpointer(ckpt_root, tcfg.checkpoint_keep, tcfg.checkpoint_async, rank, publisher)
    position, start_step, skipped = 0, 0, 0
    resume_from = find_resume_checkpoint(tcfg.resume, ckpt_root, store, mcfg, spec["identity"], rank)
    if resume_from is not None:
        loaded = ckpt.load(resume_from, model, optimizer, rank)
        meta = loaded["meta"]
        start_step, position, skipped = meta["step"], meta["position"], meta.get("skipped_steps", 0)
        if "rng" in loaded["rank_state"]:
            torch.set_rng_state(loaded["rank_state"]["rng"])
        if scaler is not None and "scaler_scale" in meta:
            scaler.load_state_dict({**scaler.state_dict(), "scale": meta["scaler_scale"]})
        log.info("resumed from %s at step %d (data position %d)", resume_from, start_step, position)

    monitor = Monitor(run_dir, rank, world, tcfg.loss_spike_factor, tcfg.straggler_zscore, tcfg.log_interval)
    if rank == 0:
        monitor.event(
            "start",
            world=world,
            step=start_step,
            resumed_from=str(resume_from) if resume_from else None,
            params=count_params(unwrap(model)),
            flops_per_token=n_flops,
        )
    tokens_per_step = tcfg.micro_batch_size * tcfg.grad_accum_steps * world * seq_len
    bad_in_row, last_loss = 0, float("nan")

    def micro_loss(batch: torch.Tensor) -> torch.Tensor:
        with autocast(tcfg, device):
            logits = model(input_ids=batch[:, :-1]).logits
        return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())

    for step in range(start_step + 1, tcfg.steps + 1):
        state["step"] = step
        watchdog.beat()
        fault_tick(tcfg.faults, rank, step)
        t0 = time.perf_counter()
        data_s = fwd_bwd_s = forward_s = 0.0
        loss_sum = torch.zeros((), dtype=torch.float64)
        first_batch = None  # replayed to name the culprit module if the step turns out non-finite
        for micro in range(tcfg.grad_accum_steps):
            t_data = time.perf_counter()
            batch = sampler.batch(position, device)
            first_batch = batch if first_batch is None else first_batch
            position += 1
            t_fb = time.perf_counter()
            data_s += t_fb - t_data
            sync = micro == tcfg.grad_accum_steps - 1 or not hasattr(model, "no_sync")
            with model.no_sync() if not sync else contextlib.nullcontext():
                loss = micro_loss(batch) / tcfg.grad_accum_steps
                forward_s += time.perf_counter() - t_fb
                (scaler.scale(loss) if scaler is not None else loss).backward()
            loss_sum += loss.detach().double()
            fwd_bwd_s += time.perf_counter() - t_fb

        # all ranks agree on the loss and on whether this step is usable
        t_comm = time.perf_counter()
        agreed = torch.stack([loss_sum, torch.tensor(0.0 if checkpointer.pending_done() else 1.0, dtype=torch.float64)])
        dist.all_reduce(agreed)
        comm_s = time.perf_counter() - t_comm
        step_loss = float(agreed[0]) / world
        t_opt = time.perf_counter()
        set_lr(optimizer, lr_at(step - 1, tcfg))
        if math.isfinite(step_loss):  # every rank has the same all-reduced loss, so all take one branch
            grad_norm, stepped = clip_and_step(model, optimizer, tcfg.grad_clip, scaler)
        else:  # a non-finite loss never reaches the optimizer, whatever the gradients look like
            optimizer.zero_grad(set_to_none=True)
            if scaler is not None:
                scaler.update(scaler.get_scale() * scaler.get_backoff_factor())
            grad_norm, stepped = float("nan"), False
        opt_s = time.perf_counter() - t_opt
        if stepped:
            bad_in_row, last_loss = 0, step_loss
        else:
            skipped += 1
            bad_in_row += 1
            culprit = first_nonfinite_module(model, lambda b=first_batch: micro_loss(b))
            monitor.event(
                "nonfinite_step",
                step=step,
                loss=step_loss,
                grad_norm=grad_norm,
                skipped_total=skipped,
                first_nonfinite_module=culprit,
            )
        step_s = time.perf_counter() - t0
        record = {
            "step": step,
            "loss": step_loss,
            "grad_norm": grad_norm,
            "lr": optimizer.param_groups[0]["lr"],
            "stepped": stepped,
            "skipped_steps": skipped,
            "tokens_per_s": tokens_per_step / step_s,
            "mfu": mfu(tokens_per_step / step_s, n_flops, tcfg.peak_tflops, world),
            "step_s": step_s,
            "data_s": data_s,
            "fwd_bwd_s": fwd_bwd_s,
            "optimizer_s": opt_s,
            "comm_s": comm_s,
            "forward_s": forward_s,
            "peak_memory_bytes": peak_memory_bytes(device),
            "time": time.time(),
        }
        monitor.log_step(record)
        if rank == 0 and (step % tcfg.log_interval == 0 or step == tcfg.steps):
            log.info(
                "step %d/%d loss %.4f grad_norm %.3f lr %.2e %.0f tokens/s",
                step,
                tcfg.steps,
                step_loss,
                grad_norm,
                record["lr"],
                record["tokens_per_s"],
            )
        if step % tcfg.straggler_interval == 0:
            monitor.check_stragglers(step)
        if checkpointer.has_pending and agreed[1] == 0:
            checkpointer.finish_pending()  # every rank's async save is on disk: publish it atomically
        if bad_in_row >= tcfg.max_bad_steps:
            checkpointer.finish_pending()
            # the same choice as resume: the newest checkpoint whose hashes verify, local or stored
            target = find_resume_checkpoint("auto", ckpt_root, store, mcfg, spec["identity"], rank)
            if target is None:
                raise RuntimeError(
                    f"{bad_in_row} non-finite steps in a row (train.max_bad_steps="
                    f"{tcfg.max_bad_steps}) and no checkpoint to roll back to"
                )
            ckpt.load(target, model, optimizer, rank)
            monitor.event("rollback", step=step, to=target.name, data_position_kept=position)
            bad_in_row = 0
        if step % tcfg.checkpoint_interval == 0 or step == tcfg.steps:
            meta = {
                "step": step,
                "position": position,
                "loss": last_loss,
                "skipped_steps": skipped,
                "identity": spec["identity"],
                "model": spec["model"],
                "world": world,
                "dataset": spec["dataset"],
            }
            if scaler is not None:
                meta["scaler_scale"] = scaler.get_scale()
            checkpointer.save(step, model, optimizer, meta, {"rng": torch.get_rng_state()})

    checkpointer.finish_pending()
    export_dir = run_dir / "export"
    export_hf(model, mcfg, mcfg.vocab_size or vocab, data_dir / "tokenizer", export_dir, rank)
    watchdog.stop()
    if rank == 0:
        publisher.join()
        checkpointer.prune()
        final = ckpt.local_checkpoints(ckpt_root)[0]
        result = {
            "final_loss": last_loss,
            "steps": tcfg.steps,
            "skipped_steps": skipped,
            "checkpoint": final.name,
            "checkpoint_version": f"{spec['identity']}-step{ckpt.step_of(final)}",
            "export_dir": str(export_dir),
            "publish_errors": publisher.errors,
            "world": world,
        }
        (run_dir / "result.json").write_text(json.dumps(result, indent=2))
        monitor.event("end", **result)
    monitor.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
