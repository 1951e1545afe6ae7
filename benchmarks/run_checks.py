"""run_checks: the cost of training's run-time checks (issue 24): the weight fingerprints
compared across the DDP replicas every `train.sdc_interval`=50 steps, plus the loss-spike
guard with `train.on_spike=rollback` on every step, vs the same training with both off
(`train.sdc_interval=0`, `train.on_spike=off`).

Both sides are liftoff's own training launched through TorchX on 2 ranks x 1 process, same
model, data, precision, schedule and threads; steady-state tokens/s from rank 0's per-step
timestamps over steps (WARMUP, STEPS]: 100 steps holding the checks after steps 50 and 100
(a check runs after its step's timestamp, before the next step's), so everything a check
blocks is inside the window. Checkpoints only at the last step on both sides (after the
window). Runs interleave (checks, none, checks, none, ...) RUNS times; the ratio is best /
best, with the spread of the per-pair ratios, because single runs on a shared 2-core VM move
by +-10%. Target ratio >= 0.97.
"""

from __future__ import annotations

import os
import tempfile

from omegaconf import OmegaConf

from benchmarks.common import CORPUS, TRAIN_SHAPE, report_interleaved, steady_rate

STEPS, WARMUP = 120, 20
RUNS = int(os.environ.get("BENCH_CHECK_RUNS", "3"))
SHAPE = [
    *TRAIN_SHAPE,
    f"train.steps={STEPS}",
    "train.warmup_steps=2",
    f"train.checkpoint_interval={STEPS}",
    "train.val_interval=0",
    "train.log_interval=10",
    "train.resume=never",
    "cluster.nodes=2",
    "cluster.procs_per_node=1",
    "train.precision=fp32",
    "train.activation_checkpointing=off",
]
CHECKS = {
    "checks": ["train.sdc_interval=50", "train.on_spike=rollback"],
    "none": ["train.sdc_interval=0", "train.on_spike=off"],
}


def main() -> None:
    from components.config import compose, defaults
    from components.plots import read_records
    from components.store import open_store
    from components.tokenize.stage import run_tokenize
    from components.train.stage import run_train

    rates: dict[str, list[float]] = {"checks": [], "none": []}
    with tempfile.TemporaryDirectory() as tmp:
        base = OmegaConf.to_object(compose([f"data.paths=[{CORPUS}]", *SHAPE]))
        store_cfg = defaults("store", root=f"{tmp}/store", cache_dir=f"{tmp}/cache")
        store = open_store(store_cfg)
        ds = str(run_tokenize(base.data, base.tokenizer, base.model, store).manifest.ref)
        world = base.cluster.nodes * base.cluster.procs_per_node
        for attempt in range(RUNS):
            for side, overrides in CHECKS.items():
                cfg = OmegaConf.to_object(
                    compose([f"data.paths=[{CORPUS}]", f"train.run_dir={tmp}/{side}-{attempt}", *SHAPE, *overrides])
                )
                result = run_train(ds, cfg.model, cfg.train, cfg.cluster, store_cfg, store, cache_gb=cfg.data.cache_gb)
                steps, records = read_records(result.metrics)
                assert not [e for e in records if e["kind"] in ("sdc", "sdc_mismatch", "rollback")], "a check fired"
                stamps = {s["step"]: s["time"] for s in steps}
                tokens = cfg.train.micro_batch_size * cfg.data.seq_len * world
                rates[side].append(steady_rate(stamps, tokens, (WARMUP, STEPS)))
    report_interleaved("run_checks", rates["checks"], rates["none"], ("with checks", "without"), world=world,
                       sdc_interval=50, window_steps=[WARMUP, STEPS])  # fmt: skip


if __name__ == "__main__":
    main()
