"""What the benchmarks measure, checked without running them: pipeline_overhead counts each
task's work from the `compute` event each component's stage_task hands back (every name a
component opens its stage_task with must be known, or its work becomes overhead); train_overhead's timed window
holds liftoff's checkpoint saves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks import train_overhead
from benchmarks.pipeline_overhead import PARALLEL, SEQUENTIAL, stage_work
from components.config import compose
from tests.conftest import CORPUS

ROOT = Path(__file__).resolve().parents[1]


def printed_stage_names() -> list[str]:
    """The names every component opens its `stage_task` with (the name its compute line prints), as
    the source spells them."""
    names = []
    for path in sorted((ROOT / "components").glob("*/component.py")):
        names += re.findall(r'with stage_task\(\s*"([^"]+)"', path.read_text())
    return names


def test_the_benchmark_expects_exactly_the_stages_the_components_report():
    names = printed_stage_names()
    assert sorted(set(names)) == sorted({*SEQUENTIAL, PARALLEL}), names


def run_output(shards: list[float]) -> str:
    """A run's output as stage_task writes its events (indented, as under `liftoff run -v`)."""
    from components.events import line

    lines = ["    " + line("compute", stage="tokenize-plan", seconds=2.0)]
    lines += [f"    [task] {line('compute', stage='tokenize-shard', seconds=s)}" for s in shards]
    lines += ["    " + line("compute", stage="tokenize-merge", seconds=0.5)]
    lines += [line("compute", stage="preflight", seconds=10)]
    lines += [line("compute", stage=n, seconds=1.0) for n in ("train", "validate", "evaluate")]
    return "\n".join(["11:43:43.195 - INFO - Executing task 'tokenize-plan'", *lines, "done"])


def test_tokenize_tasks_count_as_work_and_concurrent_shards_once():
    work, shards = stage_work(run_output([4.0]), parallelism=4)
    assert work["tokenize-plan"] == 2.0 and work["tokenize-shard"] == 4.0 and work["tokenize-merge"] == 0.5
    assert sum(work.values()) == pytest.approx(2.0 + 4.0 + 0.5 + 10.0 + 3.0) and shards == [4.0]
    # 4 shards side by side: the slowest one's time, not their sum
    assert stage_work(run_output([3.0, 4.0, 3.5, 2.0]), parallelism=4)[0]["tokenize-shard"] == 4.0
    # 4 shards 2 at a time: at least half their sum
    assert stage_work(run_output([3.0, 4.0, 3.5, 2.0]), parallelism=2)[0]["tokenize-shard"] == 6.25


def test_a_stage_without_its_line_fails_the_benchmark():
    with pytest.raises(SystemExit, match=r"missing \['tokenize-merge'\]"):
        stage_work(run_output([4.0]).replace("tokenize-merge", "tokenize-mrg"), parallelism=4)


def test_train_overhead_times_whole_checkpoint_intervals_saves_included():
    """liftoff saves every train.checkpoint_interval steps and at the last, each save after its
    step's timestamp: the window must hold whole intervals, each with its save, on both sides."""
    cfg = compose([f"data.paths=[{CORPUS}]", *train_overhead.SHAPE]).train
    steps, interval = cfg.steps, cfg.checkpoint_interval
    assert interval == train_overhead.CHECKPOINT_INTERVAL and cfg.val_interval == 0
    start, end = train_overhead.WINDOW
    assert 1 <= start < end <= steps and start % interval == 0 and end % interval == 0
    # a run whose steps take 1 s and whose saves block 5 s after their step's timestamp
    stamps, now, saved = {}, 0.0, []
    for step in range(1, steps + 1):
        now += 1.0
        stamps[step] = now
        if step % interval == 0 or step == steps:
            now += 5.0
            saved.append(step)
    inside = [s for s in saved if start <= s < end]  # a save at s lies between stamps s and s+1
    assert len(inside) == (end - start) // interval >= 1
    assert train_overhead.steady_rate(stamps, 1) == pytest.approx((end - start) / ((end - start) + 5.0 * len(inside)))
