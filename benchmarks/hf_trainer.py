"""hf_trainer: liftoff's train stage against what a user would pick instead, Hugging Face's
`Trainer`, on the same Llama shape (4 layers x 256, micro batch 16, seq 64), data, precision
(bf16) and batch, each in one process with the same threads.

liftoff trains through its own launch (TorchX local_cwd, torchrun, one process: its loop with
monitoring, the loss agreement, the non-finite and spike guards, logging); `Trainer` runs in a
process of its own (`use_cpu`, bf16 autocast, AdamW with the same betas, weight decay, clipping and
warmup-then-cosine schedule) on the very blocks liftoff's sampler hands its first steps. Both are
measured the same way: steady-state tokens/s from per-step timestamps (liftoff's metrics records,
a `TrainerCallback` on `Trainer`'s side) over the steps after WARMUP; nothing is checkpointed or
validated inside the window on either side (liftoff saves at its last step, after it; `Trainer`
saves nothing). The runs are interleaved RUNS times; the ratio is best / best, and the spread of
the per-pair ratios is reported (single runs on a shared 2-core VM move by +-10%). Target >= 1.0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import torch
from omegaconf import OmegaConf

from benchmarks.common import CORPUS, TRAIN_SHAPE, report_interleaved, steady_rate

STEPS = int(os.environ.get("BENCH_HF_STEPS", "40"))
RUNS = int(os.environ.get("BENCH_HF_RUNS", "3"))
WARMUP = max(1, STEPS // 4)  # timed: steps in (WARMUP, STEPS]
SHAPE = [
    *TRAIN_SHAPE,
    f"train.steps={STEPS}",
    "train.warmup_steps=2",
    f"train.checkpoint_interval={STEPS}",  # after the window: Trainer saves nothing
    "train.val_interval=0",
    "train.log_interval=10",
    "train.resume=never",
    "cluster.nodes=1",
    "cluster.procs_per_node=1",
    "train.precision=bf16",
    "train.activation_checkpointing=off",
]


def hf_side(blocks_path: str) -> None:
    """`Trainer` on the blocks in `blocks_path` (one process); prints its tokens/s."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from components.config import compose
    from components.models import build_model

    cfg = OmegaConf.to_object(compose([f"data.paths=[{CORPUS}]", *SHAPE]))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    blocks = torch.load(blocks_path)  # [STEPS * micro, seq + 1]: liftoff's first STEPS batches

    class Blocks(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(blocks)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": blocks[i, :-1], "labels": blocks[i, :-1]}  # Trainer's model shifts the labels

    stamps: dict[int, float] = {}

    class Stamps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps[state.global_step] = time.perf_counter()

    t = cfg.train
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=t.micro_batch_size, max_steps=STEPS,
            learning_rate=t.lr, warmup_steps=t.warmup_steps, lr_scheduler_type="cosine",
            weight_decay=t.weight_decay, adam_beta1=t.beta1, adam_beta2=t.beta2, max_grad_norm=t.grad_clip,
            bf16=True, use_cpu=True, dataloader_num_workers=0, report_to=[], save_strategy="no",
            eval_strategy="no", logging_steps=10, seed=t.seed, disable_tqdm=True,
        )  # fmt: skip
        model = build_model(cfg.model, cfg.model.vocab_size or 1024, t.seed)
        Trainer(model=model, args=args, train_dataset=Blocks(), callbacks=[Stamps()]).train()
    tokens = t.micro_batch_size * cfg.data.seq_len
    print(json.dumps({"hf_tokens_per_s": steady_rate(stamps, tokens, (WARMUP, STEPS))}))


def run_hf(blocks_path: str) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count() or 1)}  # liftoff's one process: every core
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.hf_trainer", "--hf", blocks_path],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        check=True,
    )
    return next(json.loads(ln)["hf_tokens_per_s"] for ln in proc.stdout.splitlines() if "hf_tokens_per_s" in ln)


def first_batches(store, dataset: str, cfg) -> torch.Tensor:
    """The blocks liftoff's sampler hands its first STEPS steps, in order."""
    from components.store import Ref
    from components.stream import open_split
    from components.train.data import BlockSampler

    blocks = open_split(store, store.manifest(Ref.parse(dataset)), "train", cfg.data.cache_gb)
    try:
        sampler = BlockSampler(blocks, cfg.train.micro_batch_size, 1, 1, 0, cfg.train.seed)
        n = sampler.samples_per_micro_batch
        return torch.cat([sampler.batch(s * n, torch.device("cpu")) for s in range(STEPS)])
    finally:
        blocks.close()


def main() -> None:
    from components.config import compose, defaults
    from components.plots import read_records
    from components.store import open_store
    from components.tokenize.stage import run_tokenize
    from components.train.stage import run_train

    with tempfile.TemporaryDirectory() as tmp:
        cfg = OmegaConf.to_object(compose([f"data.paths=[{CORPUS}]", f"train.run_dir={tmp}/runs", *SHAPE]))
        cfg.store = defaults("store", root=f"{tmp}/store", cache_dir=f"{tmp}/cache")
        store = open_store(cfg.store)
        dataset = str(run_tokenize(cfg.data, cfg.tokenizer, cfg.model, store).manifest.ref)
        torch.save(first_batches(store, dataset, cfg), f"{tmp}/blocks.pt")
        ours_runs, hf_runs = [], []
        for attempt in range(RUNS):
            cfg.train.run_dir = f"{tmp}/runs-{attempt}"
            result = run_train(dataset, cfg.model, cfg.train, cfg.cluster, cfg.store, store, cache_gb=cfg.data.cache_gb)
            steps, _ = read_records(result.metrics)
            tokens = cfg.train.micro_batch_size * cfg.data.seq_len
            ours_runs.append(steady_rate({s["step"]: s["time"] for s in steps}, tokens, (WARMUP, STEPS)))
            hf_runs.append(run_hf(f"{tmp}/blocks.pt"))
    report_interleaved(
        "hf_trainer", ours_runs, hf_runs, ("liftoff", "transformers.Trainer"), window_steps=[WARMUP, STEPS]
    )


if __name__ == "__main__":
    if "--hf" in sys.argv:
        hf_side(sys.argv[sys.argv.index("--hf") + 1])
    else:
        main()
