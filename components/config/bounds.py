"""`BOUNDS`: the range of every numeric key, in one table, and `out_of_bounds`, which holds a
group's values to it. Rules between keys are `rules.py`'s."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

# The range of every numeric key, in one table: `>= a`, `> a`, or an interval `[a, b)` (any
# of `[ ( ) ]`), with an optional note. A float must be finite as well (OmegaConf reads `inf`
# and `nan` as floats: `train.lr=inf` would reach training and fail there), None passes an
# optional key, and a list's items and a dict's values are each held to the bound. Rules
# between keys (warmup < steps, heads divisible by kv heads) are rules.py's, GROUP_RULES;
# a test asserts every numeric field is here or in NOT_BOUNDED.
BOUNDS: dict[str, str | tuple[str, str]] = {
    "cluster.spare_nodes": ">= 0",
    "preflight.numerics_s": ">= 0",
    "cluster.quarantine_ttl_h": ">= 0",
    "data.min_chars": ">= 1",
    "data.max_doc_bytes": ">= 1",
    "data.val_fraction": "(0, 1)",
    "data.seq_len": ">= 2",
    "data.num_proc": ">= 1",
    "data.shards": ">= 1",
    "data.parallelism": ">= 1",
    "data.cache_gb": "> 0",
    "tokenizer.vocab_size": (">= 260", "256 bytes + special tokens"),
    "tokenizer.min_frequency": ">= 0",
    "tokenizer.sample_mb": ">= 1",
    "model.vocab_size": ">= 1",
    "model.hidden_size": ">= 1",
    "model.num_layers": ">= 1",
    "model.num_heads": ">= 1",
    "model.num_kv_heads": ">= 1",
    "model.ffn_hidden_size": ">= 1",
    "model.max_seq_len": ">= 1",
    "model.rope_theta": "> 0",
    "model.num_experts": (">= 0", "0: no experts (llama); the moe family's rules ask for 2+"),
    "model.experts_per_token": (">= 0", "0: no routing (llama); moe: 1 to num_experts"),
    "model.router_aux_loss_coef": ">= 0",
    "train.ac_every_n_blocks": ">= 1",
    "train.micro_batch_size": ">= 1",
    "train.loss_chunk_tokens": (">= 0", "0: the whole micro-batch at once"),
    "train.grad_accum_steps": ">= 1",
    "train.steps": ">= 1",
    "train.lr": "> 0",
    "train.warmup_steps": ">= 0",
    "train.min_lr": ">= 0",
    "train.weight_decay": ">= 0",
    "train.beta1": "[0, 1)",  # torch's Adam refuses any other
    "train.beta2": "[0, 1)",
    "train.grad_clip": (">= 0", "0 disables"),
    "train.seed": ">= 0",  # numpy's SeedSequence takes no negative seed
    "train.checkpoint_interval": ">= 1",
    "train.checkpoint_keep": ">= 1",
    "train.checkpoint_block_kib": ">= 4",
    "train.log_interval": ">= 1",
    "train.val_interval": (">= 0", "0 disables"),
    "train.max_bad_steps": ">= 1",
    "train.loss_spike_factor": ("> 1", "times the running median loss"),
    "train.max_spikes": ">= 0",
    "train.sdc_interval": (">= 0", "0 disables"),
    "train.dp_replicate": (">= 1", "1: no HSDP replicas"),
    "train.tp": (">= 1", "1: no tensor parallelism"),
    "train.pp": (">= 1", "1: no pipeline parallelism"),
    "train.straggler_interval": ">= 1",
    "train.straggler_zscore": "> 0",
    "train.watchdog_timeout_s": "> 0",
    "train.metrics_port": ("[0, 65535]", "0 disables"),
    "train.profile_poll_steps": ">= 1",
    "train.peak_tflops": "> 0",
    "preflight.gemm_size": ">= 1",
    "preflight.gemm_iters": ">= 1",
    "preflight.membw_mb": ">= 1",
    "preflight.membw_mb_gpu": ">= 1",
    "preflight.allreduce_sizes_mb": "> 0",
    "preflight.allreduce_sizes_mb_gpu": "> 0",
    "preflight.read_probe_mb": ">= 1",
    "preflight.zscore_threshold": "> 0",
    "preflight.max_age_min": ">= 0",
    "preflight.floors": ">= 0",
    "preflight.min_healthy_nodes": ">= 1",
    "preflight.memory_headroom": "[0, 1)",
    "preflight.device_memory_gb": "> 0",
    "eval.val_blocks": (">= 0", "0 = the whole val split"),
    "eval.batch_size": ">= 1",
    "eval.loss_tolerance": "> 0",
    "eval.max_new_tokens": ">= 1",
    "cluster.nodes": ">= 1",
    "cluster.procs_per_node": ">= 1",
    "cluster.cpu": ">= 1",
    "cluster.gpu": ">= 0",
    "cluster.mem_mb": ">= 1",
    "cluster.rdzv_port": ("[0, 65535]", "0: a free port per job"),
    "cluster.max_restarts": ">= 0",
    "cluster.extra_resources": ">= 1",
    "cluster.ephemeral_storage_gb": (">= 0", "0: no request"),
    "cluster.job_ttl_s": ">= 0",
    "cluster.pending_timeout_s": "> 0",
    "store.timeout_s": "> 0",
    "kfp.wait_timeout_s": "> 0",
    "kfp.task_cpu": "> 0",
    "kfp.task_memory_gb": "> 0",
    "kfp.eval_memory_gb": "> 0",
    "kfp.task_retries": ">= 0",
}
# torch.distributed.pipelining's schedules (train.pp_schedule: the names start with a digit, so
# a string the rules check, not an Enum) and the stages each pipeline rank holds in them
PIPELINE_SCHEDULES = {"1f1b": 1, "gpipe": 1, "interleaved_1f1b": 2}

NOT_BOUNDED = {
    "data.split_seed": "any int keys the split's hash",
    "data.mixture": "a weight per source: rules.mixture_rules (each >= 0, not all 0)",
}

_BOUND = re.compile(r"(?P<op>>=?) (?P<low>\S+)|(?P<lb>[\[(])(?P<a>\S+), (?P<b>\S+)(?P<rb>[\])])")


def _within(value: float, bound: str) -> bool:
    m = _BOUND.fullmatch(bound)
    if m is None:
        raise ValueError(f"not a bound: {bound!r}")
    if m["op"]:
        return value >= float(m["low"]) if m["op"] == ">=" else value > float(m["low"])
    a, b = float(m["a"]), float(m["b"])
    return (a <= value if m["lb"] == "[" else a < value) and (value <= b if m["rb"] == "]" else value < b)


def out_of_bounds(name: str, group: Any) -> list[str]:
    """`key: must be ..., got ...` for each of one group's values outside its BOUNDS entry."""
    found = []
    for f in dataclasses.fields(group):
        key, value = f"{name}.{f.name}", getattr(group, f.name)
        if key not in BOUNDS or value is None:
            continue
        bound, note = BOUNDS[key] if isinstance(BOUNDS[key], tuple) else (BOUNDS[key], "")
        if isinstance(value, dict):
            items = [(f"{key}.{k}", v) for k, v in value.items()]
        elif isinstance(value, list):
            items = [(f"{key}[{i}]", v) for i, v in enumerate(value)]
        else:
            items = [(key, value)]
        for where, v in items:
            finite = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            if not finite or not _within(v, bound):
                what = bound if bound[0] in "<>" else f"in {bound}"
                what = what if finite else f"a finite number {what}"
                found.append(f"{where}: must be {what}{f' ({note})' if note else ''}, got {v}")
    return found
