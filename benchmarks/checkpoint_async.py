"""checkpoint_async: how long training is blocked by an async DCP checkpoint vs a synchronous
one, for a model of >= 100 MB plus its AdamW state: medians of 5 saves each, interleaved.
Target ratio <= 0.2.

Both sides count every call the training thread makes, as the loop makes them:
sync = `save` (DCP write, fsync, hashing this rank's files, the index exchange, barriers,
rename); async = `save` (staging) plus `finish_pending` once the writes are done (which hands
sealing -- hashing, index, rename -- to a background thread). On both sides the upload of
each rank's part to the store and the commit run in that background thread, overlapping
training, and are not counted; the benchmark waits for them (uncounted) after every save so
each save starts from the same idle state.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import report


def main() -> None:
    from components.checkpoint_format import local_checkpoints, verify
    from components.config import defaults
    from components.launcher import free_port
    from components.models import build_model
    from components.optimizer import build_optimizer
    from components.store import open_store
    from components.train.checkpoint import Checkpointer, StoreTarget

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    cfg = defaults("model", hidden_size=1024, num_layers=2, num_heads=8, num_kv_heads=8, ffn_hidden_size=4096)
    model = build_model(cfg, 1024, seed=0)
    opt = build_optimizer(model, defaults("train"))
    ids = torch.randint(0, 1024, (2, 33))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    mb = sum(p.numel() * 4 for p in model.parameters()) / 1e6
    blocked: dict[str, list[float]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory() as tmp:
        store = open_store(defaults("store", root=f"{tmp}/store", cache_dir=f"{tmp}/cache"))
        for step in range(1, 7):
            for mode in ("sync", "async"):  # interleaved, so both see the same machine
                target = StoreTarget(store, f"bench-{mode}", "identity", [])
                ckpt = Checkpointer(Path(tmp) / mode, keep=2, async_save=mode == "async", rank=0, target=target)
                t0 = time.perf_counter()
                ckpt.save(step, model, opt, {"step": step}, {"rng": torch.get_rng_state()})
                seconds = time.perf_counter() - t0
                if mode == "async":
                    while not ckpt.pending_done():  # training steps would run here
                        time.sleep(0.005)
                    t1 = time.perf_counter()
                    ckpt.finish_pending()
                    seconds += time.perf_counter() - t1
                ckpt.wait()  # sealing (async) and the upload, overlapping training: not blocking
                if step > 1:  # the first save of each side warms up DCP's planner caches
                    blocked[mode].append(seconds)
                assert verify(local_checkpoints(Path(tmp) / mode)[0])["step"] == step
    dist.destroy_process_group()
    sync_s, async_s = statistics.median(blocked["sync"]), statistics.median(blocked["async"])
    print(
        f"model {mb:.0f} MB (+ AdamW state): blocked {async_s:.3f}s async vs {sync_s:.3f}s sync "
        f"(all runs: async {[round(x, 3) for x in blocked['async']]}, sync {[round(x, 3) for x in blocked['sync']]})"
    )
    report(
        "checkpoint_async",
        async_s,
        sync_s,
        "s blocked",
        model_mb=round(mb),
        async_runs=blocked["async"],
        sync_runs=blocked["sync"],
    )


if __name__ == "__main__":
    main()
