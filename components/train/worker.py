"""The training process torchrun starts on every rank: `python -m components.train.worker --spec-b64 ...`.

`main` reads top to bottom: set up the job -> resume -> for each step: `train_step`; at a
settling step (log, check, checkpoint) `settle` reads the unsettled steps back and logs them,
`act_on_findings` (a spike's or non-finite step's rollback or halt), the SDC check,
`checkpoint` -> `finish` (export, result). `train_step` is the whole step on one screen:
micro-batches forward/backward, all ranks agree on the loss, the guards decide on the device,
then clip and a masked step: nothing read back, so a GPU's launch queue never drains.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from components import events
from components.config import Guard, as_plain_dict, drop_none
from components.models import count_params, spec_of
from components.parallel.apply import gradient_sync
from components.parallel.tensor import local_loss, loss_scope
from components.prelaunch import ResumeError
from components.store import Ref
from components.stream import open_split
from components.train import checkpoint as ckpt
from components.train import sdc
from components.train.guards import GuardHalt, add_window, past_skipped
from components.train.handback import describe, finish, hand_back, training_facts
from components.train.job import Job, TrainState, build_job, forward_loss, micro_loss
from components.train.monitor import DeviceTimer, StepLine, device_peak_tflops, peak_memory_bytes, step_text
from components.train.nonfinite import earliest_culprit, first_nonfinite_module
from components.train.optim import clip, lr_at, masked_step, set_lr
from components.train.profiler import Profiler
from components.train.resume import Resumed, find_resume_checkpoint
from components.train.rollback import quarantine_rank, restore_state, roll_back
from components.train.spec import TrainSpec
from components.worker_side import PLUGIN_ENV, exit_now, worker_spec

log = logging.getLogger("liftoff.train")


def resume(job: Job, state: TrainState) -> Resumed | None:
    """Load the checkpoint `train.resume` chooses among the store's versions into the job."""
    reads = ckpt.planned_reads(job.model, job.optimizer, job.rank)
    found = find_resume_checkpoint(
        job.train.resume, job.ckpt_root, job.store, job.model_cfg, job.identity, job.rank, job.train.steps, reads
    )
    if job.spec.trains_no_step and (found is None or found.step < job.train.steps):
        now = f"the newest that verifies is {found.ref} at step {found.step}" if found else "none verifies"
        raise ResumeError(
            f"preflight was skipped: the store held this training at train.steps={job.train.steps}, but {now}; "
            "rerun: preflight then measures the fleet before any step trains"
        )
    if found is None:
        return None
    loaded = ckpt.load(found.path, job.model, job.optimizer, job.rank)
    # the history up to the checkpoint: this run's own, or a seed's (the steps this model went through)
    restore_state(job, state, found, loaded)
    job.recipe.after_optimizer_step(job.model, job.train, job.fsdp)  # scales of the loaded weights
    log.info("resumed from %s at step %d (global sample %d)", found.ref, state.step, state.samples)
    return found


@dataclass
class Unsettled:
    """A step the device has been given but the host has not read back: its figures are device
    tensors until `settle` reads every unsettled step's at once."""

    step: int
    first_sample: int  # the global sample its first micro-batch began at
    samples: int  # the data position after it
    first_batch: torch.Tensor  # replayed to name the culprit module if it turns out non-finite
    forward: DeviceTimer
    device: torch.Tensor  # float64: loss, grad norm, stepped, spike, median, pending ranks, expert tokens...
    host: dict  # what the host knows already: timings, lr, peak memory
    done: float = 0.0  # perf_counter when the host finished it


def train_step(job: Job, state: TrainState) -> Unsettled:
    """One optimizer step, decided on the device: micro-batches forward/backward, all ranks agree
    on the loss (an all-reduce, never read back here), the guards judge it and the optimizer step
    is masked by their decision. No host read of a device value: `settle` reads them later."""
    t0, first_sample = time.perf_counter(), state.samples
    accum, forward, data_s = job.train.grad_accum_steps, DeviceTimer(job.device), 0.0
    loss_sum = torch.zeros((), device=job.device)
    loads: list[torch.Tensor] = []  # a mixture of experts': the tokens each expert took, per micro-batch
    first_batch = None  # replayed to name the culprit module if the step turns out non-finite
    pipelined = []  # under pipeline parallelism: the step's micro-batches, run by the schedule
    for micro in range(accum):
        t_data = time.perf_counter()
        state.samples = past_skipped(state.samples, job.sampler.samples_per_micro_batch, state.skip_windows)
        batch = job.sampler.batch(state.samples, job.device)
        data_s += time.perf_counter() - t_data
        first_batch = batch if first_batch is None else first_batch
        state.samples += job.sampler.samples_per_micro_batch
        if job.pipeline is not None:
            pipelined.append(batch)
            continue
        with gradient_sync(job.model, micro == accum - 1, job.train.fsdp_sync_every_microbatch), loss_scope(job.model):
            with forward:
                loss = forward_loss(job, batch, loads) / accum
            (job.scaler.scale(loss) if job.scaler is not None else loss).backward()
        loss_sum += local_loss(loss.detach())
    if pipelined:  # forward and backward of every micro-batch through the stages
        with forward:
            loss_sum = job.pipeline.step(torch.cat(pipelined))

    # all ranks agree on the loss and on whether every rank's async checkpoint is on disk
    t_comm = time.perf_counter()
    pending = 0.0 if job.checkpointer.pending_done() else 1.0
    load = torch.stack(loads).sum(0) if loads else torch.zeros(0, device=job.device)  # experts' tokens, summed too
    loss_and_pending = torch.cat([torch.stack([loss_sum, torch.full((), pending, device=job.device)]), load])
    with job.collectives.collective("all_reduce", "loss", state.step):
        dist.all_reduce(loss_and_pending)
    comm_s = time.perf_counter() - t_comm
    step_loss = loss_and_pending[0].double() / job.dims.loss_holders()  # every rank of the last stage holds a loss

    t_opt = time.perf_counter()
    set_lr(job.optimizer, lr_at(state.step - 1, job.train))
    # every rank has the same all-reduced loss, norm and recent losses, so all decide alike
    pp_group = job.pipeline.group if job.pipeline is not None else None
    norm = clip(job.model, job.optimizer, job.train.grad_clip, job.scaler, pp_group)
    decision = job.guards.decide(step_loss, norm)
    masked_step(job.optimizer, decision.stepped, job.scaler)
    job.recipe.after_optimizer_step(job.model, job.train, job.fsdp)  # a skipped step's scales are the same
    job.guards.join(step_loss, decision)
    opt_s = time.perf_counter() - t_opt
    grad_norm = torch.where(decision.passed, norm.double(), math.nan)  # a dropped step has none
    decided = (decision.stepped.double(), decision.spike.double(), decision.median, loss_and_pending[1].double())
    flags = torch.stack([step_loss, grad_norm, *decided])
    step_s = time.perf_counter() - t0
    host = {
        "lr": job.optimizer.param_groups[0]["lr"],
        "step_s": step_s,
        "data_s": data_s,
        "fwd_bwd_s": step_s - comm_s - opt_s - data_s,
        "optimizer_s": opt_s,
        "comm_s": comm_s,
        "peak_memory_bytes": peak_memory_bytes(job.device),
    }
    device = torch.cat([flags, loss_and_pending[2:].double()])
    return Unsettled(state.step, first_sample, state.samples, first_batch, forward, device, host, time.perf_counter())


def settles_at(job: Job, step: int) -> bool:
    """Whether the loop reads its unsettled steps back after `step`: where it logs, checks
    (stragglers, validation, SDC) or checkpoints, and at the last step."""
    t = job.train
    return (
        step % t.log_interval == 0
        or step == t.steps
        or step % t.straggler_interval == 0
        or step % t.checkpoint_interval == 0
        or validates_at(step, t.val_interval, t.steps)
        or sdc.due(step, t)
    )


def settle(job: Job, state: TrainState, steps: list[Unsettled], line: StepLine, settled_at: float) -> dict | None:
    """Read every unsettled step's figures back at once (the one host read in `train.log_interval`
    steps) and do, step by step, what the host does after a step: its findings (events, the
    loop's state), its record (metrics, the step line), the async checkpoint's publication, a
    rollback or a halt. The last step's record; None when the run rewound (the steps after the
    one that rewound it are dropped: the rewind goes back past them). On a GPU the host ran ahead
    of the device: each step's time is the interval's mean."""
    values = torch.stack([u.device for u in steps]).tolist()
    now, current = time.perf_counter(), (state.step, state.samples)
    record = None
    for u, v in zip(steps, values, strict=True):
        loss, grad_norm, stepped, spike, median, pending_ranks, *expert_tokens = v
        state.step, state.samples = u.step, u.samples  # as the step left them
        step_s = (now - settled_at) / len(steps) if job.device.type == "cuda" else u.host["step_s"]
        record_outcome(job, state, bool(spike), bool(stepped), loss, grad_norm, median, u)
        routed = sum(expert_tokens)
        record = {
            **({"expert_load": [n / routed for n in expert_tokens]} if routed else {}),  # each expert's share
            "step": u.step,
            "loss": loss,
            "grad_norm": grad_norm,
            "stepped": bool(stepped),
            "spike": bool(spike),
            "skipped_steps": state.skipped,
            "tokens_per_s": job.tokens_per_step / step_s,
            **u.host,
            "step_s": step_s,
            "forward_s": u.forward.seconds(),
            "checkpoint_pending_ranks": pending_ranks,
            "time": time.time() - (now - u.done),
            **({"drawn": job.sampler.drawn(u.samples)} if job.spec.mixture else {}),  # per source, so far
        }
        record["mfu"] = line.mfu(record["tokens_per_s"])
        record.update(job.checkpointer.seconds)
        job.monitor.log_step(record)
        if job.rank == 0 and (figures := line.add(record)):
            log.info(step_text(figures))
            events.emit("step", **figures)
        if job.checkpointer.has_pending and pending_ranks == 0:
            job.checkpointer.finish_pending()  # on disk everywhere: seal and publish it
        if act_on_findings(job, state, record):
            return None  # rewound: on from the checkpoint's step
    state.step, state.samples = current
    return record


def record_outcome(job: Job, state: TrainState, spike: bool, stepped: bool, step_loss: float, grad_norm: float,
                   median: float, u: Unsettled) -> None:  # fmt: skip
    """The loop's state and the events after the device's decision on step `u`."""
    if spike:
        state.spike_from = state.spike_from if state.spikes_in_row else (u.step, u.first_sample)
        state.spike_row = (state.spike_row if state.spikes_in_row else []) + [(u.step, step_loss)]
        state.spikes_in_row += 1
        state.skipped += not stepped
        job.monitor.event("loss_spike", step=u.step, loss=step_loss, running_median=median,
                          factor=job.train.loss_spike_factor, action=job.train.on_spike.value,
                          samples=[u.first_sample, u.samples])  # fmt: skip
        if job.monitor.exporter is not None:
            job.monitor.exporter.spike()
    else:
        state.spikes_in_row = 0
    if stepped:
        state.bad_in_row, state.last_loss = 0, step_loss
    if math.isfinite(step_loss) and (stepped or spike):
        job.guards.stepped(step_loss, spike)  # a spike joins the median only where the guard lets the run go on
    elif not spike:
        state.skipped += 1
        state.bad_in_row += 1
        mine = first_nonfinite_module(job.model, lambda b=u.first_batch: micro_loss(job, b))
        culprit = earliest_culprit(mine, spec_of(job.model))
        job.monitor.event(
            "nonfinite_step",
            step=u.step,
            loss=step_loss,
            grad_norm=grad_norm,
            skipped_total=state.skipped,
            first_nonfinite_module=culprit,
        )


def act_on_findings(job: Job, state: TrainState, record: dict) -> bool:
    """What the guards decide after a step (components/train/guards.py): a rollback or a halt.
    True when the run rewound (the loop goes on from the checkpoint's step)."""
    step, t = state.step, job.train
    if record["spike"] and (action := job.guards.spike_action(state.spikes_in_row)) is not None:
        first, start = state.spike_from
        why = (f"loss spike: {state.spikes_in_row} step(s) in a row from step {first} over "
               f"{t.loss_spike_factor} x the running median (train.on_spike={t.on_spike.value})")  # fmt: skip
        if action == Guard.halt:
            raise GuardHalt(f"{why}: loss {record['loss']:.4g} at step {step}")
        if first <= state.spike_rollback_from:  # it spikes again where the last rewind went past its data
            raise GuardHalt(f"{why}, again after rewinding past the data of a spike at step {first}: not the data")
        window, spikes = [start, state.samples], [list(s) for s in state.spike_row]
        state.skip_windows = add_window(state.skip_windows, *window)
        target = roll_back(job, state, first - 1, why, rewind=True)  # the history goes back: the spikes are kept here
        state.spike_rollback_from = first
        job.monitor.event("rollback", step=step, reason="loss_spike", to=str(target.ref), spikes=spikes,
                          skipped_samples=window, skipped_windows=state.skip_windows)  # fmt: skip
        return True
    if not record["stepped"] and not record["spike"]:
        action = job.guards.nonfinite_action(state.bad_in_row)
        why = f"{state.bad_in_row} non-finite step(s) in a row (train.on_nonfinite={t.on_nonfinite.value}"
        if action == Guard.halt:
            raise GuardHalt(f"{why}): loss {record['loss']} at step {step}")
        if action == Guard.rollback:  # the weights go back; the data goes on past the bad steps
            target = roll_back(job, state, step, f"{why}, train.max_bad_steps={t.max_bad_steps})", rewind=False)
            job.monitor.event("rollback", step=step, to=str(target.ref), data_samples_kept=state.samples)
            state.bad_in_row = 0
    return False


def checkpoint(job: Job, state: TrainState) -> None:
    """Save on the interval and at the last step (a verified step: sdc.check passed)."""
    if state.step % job.train.checkpoint_interval == 0 or state.step == job.train.steps:
        meta = {
            "step": state.step,
            "samples": state.samples,
            "loss": state.last_loss,
            "skipped_steps": state.skipped,
            "skipped_samples": [list(w) for w in state.skip_windows],
            "recent_losses": job.guards.state(),
            "identity": job.identity,
            "model": drop_none(as_plain_dict(job.model_cfg)),
            "world": job.world,
            "dataset": job.spec.dataset,
            **({"mixture": job.spec.mixture, "max_epochs": job.spec.max_epochs} if job.spec.mixture else {}),
        }
        if job.scaler is not None:
            meta["scaler_scale"] = job.scaler.get_scale()
        rng = {"rng": torch.get_rng_state()}
        job.checkpointer.save(state.step, job.model, job.optimizer, meta, rng, job.monitor.history)


VAL_BLOCKS = 32  # periodic validation's fixed held-out set: the val split's first blocks


def quarantine_stragglers(job: Job, slow: list[int], step: int) -> None:
    """Rank 0 records the node of each rank that straggled at two checks in a row (one check
    can be a warm-up or a moment's contention) as quarantined: the next launch keeps off it."""
    before, job.straggling = job.straggling, set(slow)
    for r in sorted(set(slow) & before):
        evidence = {"rank": r, "step": step, "z": job.monitor.last_z[r], "threshold": job.train.straggler_zscore}
        z = evidence["z"]
        reason = f"straggler: rank {r}'s forward time {z:.1f} robust SDs above its peers' at two checks to step {step}"
        quarantine_rank(job, r, "straggler", reason, evidence)


def validates_at(step: int, interval: int, last_step: int) -> bool:
    """Whether periodic validation runs after this step: every `interval` steps (train.val_interval)
    and at the last step; never with 0."""
    return interval > 0 and (step % interval == 0 or step == last_step)


def val_loss(job: Job) -> tuple[float, int] | None:
    """(mean token loss, blocks) of the model as it trains on the first VAL_BLOCKS val blocks, in
    micro batches: the same blocks every time, so the curve compares like with like. Every rank
    runs it (a collective under FSDP), without gradients; compiled blocks run eagerly."""
    return mean_loss(job, job.val)


def mean_loss(job: Job, blocks) -> tuple[float, int] | None:
    from components.blocks import batches

    n = min(VAL_BLOCKS, len(blocks))
    if n == 0:
        return None
    total = 0.0
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        for batch in batches(blocks, n, job.train.micro_batch_size):
            total += float(micro_loss(job, batch.to(job.device))) * len(batch)  # blocks of one length: a token mean
    return total / n, n


def source_val_losses(job: Job) -> dict[str, float]:
    """A mixture's val loss per source, each on its own dataset's first VAL_BLOCKS val blocks
    (opened on first use); {} for one source."""
    if not job.spec.mixture:
        return {}
    if job.val_sources is None:
        refs = job.store.manifest(Ref.parse(job.spec.dataset)).metadata["sources"]
        job.val_sources = {
            name: open_split(job.store, job.store.manifest(Ref.parse(ref)), "val", job.spec.data_cache_gb,
                             on_wait=job.watchdog.beat)
            for name, ref in refs.items()
        }  # fmt: skip
    measured = {name: mean_loss(job, blocks) for name, blocks in job.val_sources.items()}
    return {name: m[0] for name, m in measured.items() if m is not None}


def validate(job: Job, step: int) -> None:
    t0 = time.perf_counter()
    measured = val_loss(job)
    if measured is not None:
        sources = source_val_losses(job)
        job.monitor.log_val(step, *measured, time.perf_counter() - t0, sources)


def install_plugin(job: Job, state: TrainState) -> None:
    name = os.environ.get(PLUGIN_ENV)
    if name:
        importlib.import_module(name).install(job, state)


@record
def main(argv: list[str] | None = None) -> int:
    job = build_job(worker_spec(argv, TrainSpec))
    state = TrainState()
    install_plugin(job, state)
    profiler = Profiler(job.store, job.identity, job.model_cfg.name, job.spec.dataset, job.rank,
                        job.train.profile_poll_steps, job.device)  # fmt: skip
    job.on_step.append(profiler.on_step)  # `liftoff profile`: a request in the store, looked for every few steps
    resumed_from = resume(job, state)
    if job.rank == 0:
        job.monitor.event(
            "start",
            world=job.world,
            step=state.step,
            resumed_from=str(resumed_from.ref) if resumed_from else None,
            params=count_params(job.model),
            flops_per_token=job.flops_per_token,
            precision=job.train.precision.value,
            float8_linear_count=len(job.float8_modules),
            float8_linear_modules=job.float8_modules,
        )
    peak = job.train.peak_tflops or device_peak_tflops(job.device)
    line = StepLine(job.train.steps, job.train.log_interval, job.flops_per_token, peak, job.world, job.device)
    if job.rank == 0:
        facts = training_facts(job)
        log.info(describe(facts))
        events.emit("training", **facts)
        if job.device.type != "cuda" and job.float8_modules:
            log.info("fp8 on CPU is emulated: it checks the numerics, its speed means nothing")
    unsettled: list[Unsettled] = []  # steps whose figures are still on the device
    settled_at = time.perf_counter()
    while state.step < job.train.steps:
        state.step += 1
        step = state.step
        job.watchdog.beat()
        for hook in job.on_step:
            hook(step)
        job.grad_norms.arm(sdc.due(step, job.train))  # the local gradient norms a check compares
        unsettled.append(train_step(job, state))
        if not settles_at(job, step):
            continue
        record = settle(job, state, unsettled, line, settled_at)
        unsettled, settled_at = [], time.perf_counter()
        if record is None:
            continue  # rewound: on from the checkpoint's step
        profiler.settled(step)
        if step % job.train.straggler_interval == 0:
            quarantine_stragglers(job, job.monitor.check_stragglers(step), step)
        if validates_at(step, job.train.val_interval, job.train.steps):
            validate(job, step)
        if sdc.due(step, job.train) and not sdc.check(job, state, record["stepped"]):
            continue  # the replicas disagreed: never committed, rewound
        if not job.guards.holds_checkpoints(state.spikes_in_row):  # a row of spikes may still be rewound
            checkpoint(job, state)
    profiler.close(state.step)
    result = finish(job, state, resumed_from)
    job.sampler.blocks.close()  # no prefetch left running
    job.val.close()
    if result is not None:
        job.monitor.event("end", **result.to_json())
    job.monitor.close()
    if result is not None:
        hand_back(job, result)
    dist.barrier()  # every rank is done with the store torchrun's agent serves: a quiet teardown
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_now(main())
