"""Issue 40, point 6: a step that never waits on the host. On a GPU every read of a device value
by the host (`.item()`, `.tolist()`, `bool(tensor)`) drains the launch queue; the loop reads
nothing back on a plain step (the guards decide on the device, a masked optimizer step) and
settles the steps it buffered at log, check and checkpoint steps, with one read."""

from __future__ import annotations

import json

import pytest

from tests.faults import injected

LOG = 4  # settling steps: 4 and 8 (the last: it checkpoints and validates); every other step is plain
STEPS = 8
PLAIN = [s for s in range(1, STEPS) if s % LOG]


def reads(trainer, tmp_path, *layout: str) -> list[dict[int, int]]:
    out = tmp_path / "reads"
    with injected(host_reads_dir=str(out)):
        trainer.run(
            "cluster.procs_per_node=2", f"train.steps={STEPS}", f"train.log_interval={LOG}",
            f"train.checkpoint_interval={STEPS}", "train.val_interval=0", "train.sdc_interval=0",
            f"train.straggler_interval={STEPS}", "train.checkpoint_async=false", *layout,
        )  # fmt: skip
    return [{int(k): v for k, v in json.loads((out / f"rank{r}.json").read_text()).items()} for r in (0, 1)]


@pytest.mark.parametrize(
    "layout",
    [
        ("train.precision=fp8", "train.parallelism=fsdp", "train.activation_checkpointing=full"),
        ("train.precision=bf16", "train.parallelism=ddp", "train.activation_checkpointing=selective"),
        # the other two of the 2 x 2: in `make chaos` (each precision and each layout runs above)
        pytest.param(("train.precision=fp8", "train.parallelism=ddp", "train.activation_checkpointing=off"),
                     marks=pytest.mark.chaos_slow),
        pytest.param(("train.precision=bf16", "train.parallelism=fsdp", "train.activation_checkpointing=full"),
                     marks=pytest.mark.chaos_slow),
    ],
    ids=["fp8-fsdp", "bf16-ddp", "fp8-ddp", "bf16-fsdp"],
)  # fmt: skip
def test_a_plain_step_reads_nothing_back_and_a_settling_step_reads_once(trainer, tmp_path, layout):
    """Counted in the training processes themselves (a dispatch mode counting
    `aten._local_scalar_dense` and a counting `Tensor.tolist`): 0 reads on each plain step of each
    rank; the settling step reads its buffered steps back (so the counter counts: with the
    guards deciding on the host every step would read)."""
    for rank, counts in enumerate(reads(trainer, tmp_path, *layout)):
        assert [counts.get(s, 0) for s in PLAIN] == [0] * len(PLAIN), (rank, counts)
        assert counts.get(LOG, 0) >= 1, (rank, counts)
