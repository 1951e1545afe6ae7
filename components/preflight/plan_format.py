"""What `liftoff plan` prints: the plan's table (the preflight summary's too), its inputs with
where each comes from, warnings about them, and a suggestion as overrides."""

from __future__ import annotations

from collections.abc import Mapping

from components.parallel import ParallelDims, pipeline_microbatches
from components.preflight.plan import Plan, reserved_gb, verdict
from components.preflight.plan_config import PlanDevice, as_overrides, plan_for, with_changes
from components.summaries import gib

# a measured throughput is no peak (on a CPU, emulated fp8 is measured as what it is): no MFU against it
NO_PEAK = "none: no published peak for this device (cluster.gpu_type or train.peak_tflops)"


def format_plan(p: Plan, device_memory_gb: float, headroom: float) -> str:
    rows = [
        ("parameters", f"{p.params:,}"),
        ("world size", str(p.world)),
        ("weights", f"{gib(p.weights_gb):.3f} GiB"),
        ("gradients", f"{gib(p.grads_gb):.3f} GiB"),
        ("AdamW state", f"{gib(p.optimizer_gb):.3f} GiB"),
        ("precision copies", f"{gib(p.precision_copies_gb):.3f} GiB"),
        ("activations", f"{gib(p.activations_gb):.3f} GiB"),
        ("total per device", f"{gib(p.total_gb):.3f} GiB"),
        ("reserved per device", f"{gib(reserved_gb(p, headroom)):.3f} GiB (with memory_headroom {headroom}) of "
         f"{gib(device_memory_gb):.1f} GiB: {verdict(p, device_memory_gb, headroom)}"),
        ("FLOPs per token", f"{p.flops_per_token:.4g}"
         + (f" (+ {p.recompute_flops_per_token:.4g} recomputed)" if p.recompute_flops_per_token else "")),
    ]  # fmt: skip
    if p.step_time_s is not None:
        rows += [
            (
                "step time",
                f"{p.step_time_s:.4g} s (compute {p.compute_s:.4g} s, comm {p.comm_s:.4g} s, of it "
                f"{p.exposed_comm_s:.4g} s not hidden under compute"
                + (f"; the host's dispatch {p.host_s:.4g} s" if p.host_s else "")
                + ")",
            ),
            ("tokens/s", f"{p.tokens_per_s:,.0f}"),
            ("MFU", f"{p.mfu:.1%}" if p.mfu is not None else NO_PEAK),
        ]
    return _rows(rows)


def _rows(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def seq_len_source(overrides: list[str], choices: Mapping[str, str | None]) -> str:
    """Who set data.seq_len: an override, the experiment preset, or the data group. `choices`:
    Hydra's, from `compose_choices(overrides)`."""
    from omegaconf import OmegaConf

    from components.config import CONF_DIR

    if any("=" in o and o.lstrip("+~").split("=", 1)[0] == "data.seq_len" for o in overrides):
        return "data.seq_len, your override"
    preset = CONF_DIR / "experiment" / f"{choices.get('experiment')}.yaml"
    if preset.is_file() and "seq_len" in (OmegaConf.load(preset).get("data") or {}):
        return f"data.seq_len, set by experiment={choices['experiment']}"
    return f"data.seq_len, data={choices.get('data')}"


def global_batch(cfg) -> int:
    dims = ParallelDims.of(cfg.train, cfg.cluster.nodes * cfg.cluster.procs_per_node)
    return cfg.train.micro_batch_size * cfg.train.grad_accum_steps * dims.dp


def format_inputs(cfg, p: Plan, d: PlanDevice, seq_source: str) -> str:
    t, c = cfg.train, cfg.cluster
    ac = {"full": f"full, every {t.ac_every_n_blocks} block(s)", "selective": "selective (per op), every block"}
    ac = ac.get(getattr(t.activation_checkpointing, "value", t.activation_checkpointing), "off")
    fp8 = f" ({t.fp8_recipe.value})" if t.precision.value == "fp8" else ""
    busbw = f"{d.busbw_gbps:g} GB/s per GPU: " if d.busbw_gbps else ""
    return _rows([
        ("model", f"{cfg.model.name}: {p.params / 1e9:.3g}B parameters, max_seq_len {cfg.model.max_seq_len}"),
        ("seq_len", f"{cfg.data.seq_len} ({seq_source})"),
        ("micro batch", f"{t.micro_batch_size} (train.micro_batch_size)"),
        ("grad accumulation", f"{t.grad_accum_steps} (train.grad_accum_steps)" + _sync(t)),
        ("world size", f"{p.world} ({c.nodes} nodes x {c.procs_per_node} procs)"),
        ("global batch", f"{global_batch(cfg):,} sequences, {global_batch(cfg) * cfg.data.seq_len:,} tokens"),
        ("precision", f"{t.precision.value}{fp8}"),
        ("parallelism", t.parallelism.value + _hsdp(t, p.world) + _tp(t, p.world) + _pp(t, p.world)),
        ("activation ckpt", ac),
        ("device", d.name),
        ("device memory", f"{gib(d.memory_gb):.1f} GiB: {d.memory_source}"),
        ("peak", f"{d.peak_tflops:g} TFLOP/s: {d.peak_source}" if d.peak_tflops else d.peak_source),
        ("efficiency", f"linear layers at {d.efficiency:.0%} of peak, attention at {d.attention_efficiency:.0%}: "
                       f"{d.efficiency_source}"),
        ("bus bandwidth", busbw + d.busbw_source),
    ])  # fmt: skip


def _hsdp(t, world: int) -> str:
    if t.parallelism.value != "fsdp" or t.dp_replicate == 1:
        return ""
    shard = ParallelDims.of(t, world).dp_shard
    return f" (HSDP: {t.dp_replicate} replicas x {shard}-rank shard groups, train.dp_replicate)"


def _tp(t, world: int) -> str:
    if t.tp == 1:
        return ""
    return f" x tensor parallel {t.tp} (train.tp; {ParallelDims.of(t, world).dp} data-parallel ranks)"


def _pp(t, world: int) -> str:
    if t.pp == 1:
        return ""
    micro, size = pipeline_microbatches(t)
    return (f" x pipeline parallel {t.pp} (train.pp, {t.pp_schedule}, {micro} micro-batches of {size};"
            f" {ParallelDims.of(t, world).dp} data-parallel ranks; the larger end stage planned)")  # fmt: skip


def _sync(t) -> str:
    if t.grad_accum_steps == 1 or t.parallelism.value != "fsdp":
        return ""
    if t.pp > 1:  # torch's schedules sync each stage once a step, whatever the setting
        return ", reduce-scatter after the last micro-batch only (the pipeline schedule's)"
    when = "every micro-batch" if t.fsdp_sync_every_microbatch else "the last micro-batch only"
    return f", reduce-scatter after {when} (train.fsdp_sync_every_microbatch)"


def plan_warnings(cfg, seq_source: str) -> list[str]:
    """Inputs that are likely not what a run of this model would use."""
    found = []
    s, full = cfg.data.seq_len, cfg.model.max_seq_len
    if s < full / 8:
        found.append(
            f"seq_len {s} ({seq_source}) is under model.max_seq_len/8 = {full // 8}: "
            f"model {cfg.model.name} trains at {full}; add data.seq_len={full} to plan at full length"
        )
    c = cfg.cluster
    if c.gpu > c.procs_per_node:
        found.append(
            f"cluster.procs_per_node={c.procs_per_node} but cluster.gpu={c.gpu}: "
            f"{c.gpu - c.procs_per_node} GPU(s) per node idle; cluster.procs_per_node={c.gpu} uses them all"
        )
    return found


def format_suggestion(cfg, changes: dict | None) -> str:
    if changes is None:
        return (
            f"nothing fits up to {cfg.cluster.nodes * 16} nodes with activation checkpointing, FSDP and micro batch 1:"
            " a smaller model or a shorter data.seq_len"
        )
    changed = with_changes(cfg, changes)
    p, d = plan_for(changed)
    reserved = reserved_gb(p, cfg.preflight.memory_headroom)
    batch = global_batch(cfg), global_batch(changed)
    batch_note = f", global batch {batch[0]:,} -> {batch[1]:,} sequences" if batch[0] != batch[1] else ""
    return (
        f"{' '.join(as_overrides(changes))}  ({p.world} devices, {gib(reserved):.2f} of {gib(d.memory_gb):.2f} GiB"
        f" per device{batch_note})"
    )
