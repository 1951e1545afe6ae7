"""checkpoint_async: how long training is blocked by an async DCP checkpoint vs a synchronous
one, for a model of >= 100 MB (plus its AdamW state). Target ratio <= 0.2."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import report


def main() -> None:
    from components.config import ModelConfig, TrainConfig
    from components.train.checkpoint import Checkpointer
    from components.train.model import build_model
    from components.train.optim import build_optimizer

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    from components.launcher import free_port

    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    cfg = ModelConfig(hidden_size=1024, num_layers=2, num_heads=8, num_kv_heads=8, ffn_hidden_size=4096)
    model = build_model(cfg, 1024, seed=0)
    opt = build_optimizer(model, TrainConfig())
    ids = torch.randint(0, 1024, (2, 33))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    mb = sum(p.numel() * 4 for p in model.parameters()) / 1e6
    blocked = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("sync", "async"):
            ckpt = Checkpointer(Path(tmp) / mode, keep=2, async_save=mode == "async", rank=0)
            times = []
            for step in (1, 2, 3):
                t0 = time.perf_counter()
                ckpt.save(step, model, opt, {"step": step}, {"rng": torch.get_rng_state()})
                times.append(time.perf_counter() - t0)
                ckpt.finish_pending()  # the next step's agreement would finish it; not counted
            blocked[mode] = min(times[1:])
    dist.destroy_process_group()
    print(f"model {mb:.0f} MB (+ AdamW state): blocked {blocked['async']:.3f}s async vs {blocked['sync']:.3f}s sync")
    report("checkpoint_async", blocked["async"], blocked["sync"], "s blocked", model_mb=round(mb))


if __name__ == "__main__":
    main()
