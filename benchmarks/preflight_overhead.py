"""preflight_overhead: wall time of the preflight stage on 2 local nodes (TorchX local_cwd),
against the one-minute budget on CPU (printed, not asserted)."""

from __future__ import annotations

import tempfile
import time

from omegaconf import OmegaConf

from benchmarks.common import CORPUS, report

BUDGET_S = 60.0


def main() -> None:
    from components.config import compose, defaults
    from components.preflight.stage import gate, run_preflight
    from components.store import open_store
    from components.tokenize.stage import run_tokenize

    with tempfile.TemporaryDirectory() as tmp:
        cfg = OmegaConf.to_object(compose([f"data.paths=[{CORPUS}]", "cluster.nodes=2", f"train.run_dir={tmp}/runs"]))
        cfg.store = defaults("store", root=f"{tmp}/store", cache_dir=f"{tmp}/cache")
        store = open_store(cfg.store)
        ds = run_tokenize(cfg.data, cfg.tokenizer, cfg.model, store)
        t0 = time.perf_counter()
        result = run_preflight(str(ds.manifest.ref), cfg.model, cfg.train, cfg.cluster, cfg.preflight, cfg.store, store)
        gate(result, cfg.preflight)
        seconds = time.perf_counter() - t0
    print(f"preflight on 2 local nodes: {seconds:.1f}s (budget {BUDGET_S:.0f}s)")
    report("preflight_overhead", seconds, BUDGET_S, "s")


if __name__ == "__main__":
    main()
