"""`liftoff profile` against a running local 2-node training: a trace per rank lands in the store."""

from __future__ import annotations

import gzip
import json
import threading
import time

from pipelines.cli import main
from pipelines.profile import running_trainings
from tests.faults import injected


def test_liftoff_profile_traces_every_rank_of_a_running_training_into_the_store(trainer, capsys):
    done: dict = {}

    def train() -> None:
        try:
            with injected(slow_rank=0, slow_seconds=0.2):  # long enough to be found running
                done["result"] = trainer.run(
                    "cluster.nodes=2", "train.steps=30", "train.checkpoint_interval=30", "train.profile_poll_steps=2"
                )
        except BaseException as e:
            done["error"] = e

    thread = threading.Thread(target=train)
    thread.start()
    try:
        deadline = time.monotonic() + 180
        while not running_trainings(trainer.store) and time.monotonic() < deadline and thread.is_alive():
            time.sleep(0.2)
        store = [f"store.root={trainer.store_cfg.root}", f"store.cache_dir={trainer.store_cfg.cache_dir}"]
        assert main(["profile", "--steps", "3", "--timeout", "120", *store]) == 0
    finally:
        thread.join(timeout=300)
    assert "error" not in done, done.get("error")
    said = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("profile profile/")]
    ref = said[-1].split()[1].rstrip(":")

    from components.store import Ref

    manifest = trainer.store.manifest(Ref.parse(ref))
    assert manifest.metadata["steps"] == 3 and manifest.metadata["world"] == 2
    assert manifest.parents == [trainer.dataset]  # its lineage: the dataset the run trains on
    assert manifest.metadata["identity"] == done["result"].identity
    folder = trainer.store.fetch(manifest)  # every file checked against its sha256
    for rank in (0, 1):
        trace = json.loads(gzip.decompress((folder / f"rank{rank}.pt.trace.json.gz").read_bytes()))
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert any(n.startswith("aten::") for n in names), f"rank {rank}'s trace has no aten op"
        assert any(n.startswith("aten::mm") or n.startswith("aten::addmm") for n in names)
        summary = json.loads((folder / f"rank{rank}.summary.json").read_text())
        assert summary["rank"] == rank and summary["self_s"] > 0
    # rank 1's DDP all-reduces show as communication: a collective's time, not a formula's
    assert json.loads((folder / "rank1.summary.json").read_text())["comm_s"] > 0
    html = (folder / "summary.html").read_text()
    assert "rank 0" in html and "rank 1" in html
    # the training finished normally after it was profiled, and the request is marked served
    assert done["result"].result.steps == 30
