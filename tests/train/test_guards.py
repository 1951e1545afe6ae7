"""Run-time findings act (issue 24): silent data corruption across DDP replicas is found by
the weight fingerprints, its rank and node named and quarantined, and the run goes back to
the newest verified checkpoint (acceptance 2); a loss spike from a corrupted data window
rewinds the run past the window, which the model's lineage lists (acceptance 3)."""

from __future__ import annotations

import socket

import pytest

from components import fleet
from components.launcher import LaunchError
from components.plots import read_records
from components.train import guards, sdc
from tests.conftest import Trainer
from tests.faults import injected
from tests.helpers import TWO_NODES, events, final_weights

FLIPPED = "model.layers.0.mlp.up_proj.weight"
# checks after steps 4, 8, 10 (the checkpoint), 12, 16, 20: the flip after step 12 is found at 16,
# and the replay from step 10 passes the check at 12 on its way back to 16
SDC_RUN = [*TWO_NODES, "train.steps=20", "train.checkpoint_interval=10", "train.sdc_interval=4"]


@pytest.fixture(scope="module")
def clean_run(dataset_store, tmp_path_factory):
    """The uninterrupted run both SDC tests compare with, and each rank's final weights hash."""
    tmp = tmp_path_factory.mktemp("clean")
    with injected(weights_dir=str(tmp / "weights")):
        run = Trainer(dataset_store, tmp / "run").run(*SDC_RUN)
    hashes = {p.name: p.read_text() for p in (tmp / "weights").glob("rank*.txt")}
    assert len(hashes) == 2
    return run, hashes


def test_a_flipped_bit_on_one_replica_is_found_named_quarantined_and_rolled_back(clean_run, dataset_store, tmp_path):
    clean, clean_hashes = clean_run
    hit_dir = tmp_path / "hit-weights"
    hit_trainer = Trainer(dataset_store, tmp_path / "hit")
    with injected(flip_rank=1, flip_step=12, flip_param=FLIPPED, weights_dir=str(hit_dir)):
        hit = hit_trainer.run(*SDC_RUN)

    node = f"{socket.gethostname()}-node1"
    # found at the next check (step 16), never committed: the run replayed from the step-10 checkpoint
    mismatch = events(hit.metrics, "sdc_mismatch")
    assert [m["step"] for m in mismatch] == [16] and mismatch[0]["tensors"] == [FLIPPED]
    assert "-step10-" in mismatch[0]["replay_from"]
    found = events(hit.metrics, "sdc")
    assert len(found) == 1 and found[0]["ranks"] == [1] and found[0]["nodes"] == [node]
    assert found[0]["step"] == 16 and found[0]["decided_by"] == "replay" and "-step10-" in found[0]["rolled_back_to"]
    near, far = sorted(found[0]["distances"])
    assert far > 1000 * near  # rank 1 a flipped bit from the replay; rank 0 only by what it took in
    # rank 1's node is quarantined in the store, where the next launch's preflight reads it
    records = fleet.quarantined(hit_trainer.store)
    assert list(records) == [node] and records[node].source == "sdc"
    assert records[node].evidence["rank"] == 1 and records[node].evidence["tensors"] == [FLIPPED]
    assert records[node].evidence["step"] == 16
    # no bad state survives on any rank: both replicas end bit-identical to the uninterrupted run's
    assert {p.name: p.read_text() for p in hit_dir.glob("rank*.txt")} == clean_hashes
    a, b = final_weights(clean), final_weights(hit)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6
    steps, _ = read_records(hit.metrics)
    assert [s["step"] for s in steps] == list(range(1, 21))  # the history is the verified one


def test_a_rank_whose_gradient_matmul_is_off_once_is_found_by_its_norm_and_blamed_on_replay(
    clean_run, dataset_store, tmp_path
):
    """Rank 0's weight-gradient matmul is off in one element at step 12 (a check step): the
    gradient reaches both replicas through the all-reduce, so the weights agree; its local
    gradient norm before the reduction is the outlier, and the replay from step 10 does not
    reproduce it."""
    clean, clean_hashes = clean_run
    hit_trainer = Trainer(dataset_store, tmp_path / "hit")
    faults = {"perturb_rank": 0, "perturb_step": 12, "perturb_param": FLIPPED, "perturb_value": 100.0}
    with injected(**faults, weights_dir=str(tmp_path / "weights")):
        hit = hit_trainer.run(*SDC_RUN)
    outlier = events(hit.metrics, "grad_outlier")
    # two ranks far apart are both suspects; the replay from step 10 tells which one it was
    assert [(e["step"], e["ranks"]) for e in outlier] == [(12, [0, 1])] and "-step10-" in outlier[0]["replay_from"]
    node = f"{socket.gethostname()}-node0"
    found = events(hit.metrics, "sdc")
    assert [(e["step"], e["ranks"], e["nodes"], e["decided_by"]) for e in found] == [(12, [0], [node], "replay")]
    records = fleet.quarantined(hit_trainer.store)
    assert list(records) == [node] and records[node].source == "sdc"
    first, replayed = records[node].evidence["norms_first_pass"], records[node].evidence["norms"]
    assert first[0] > 10 * first[1] and replayed[0] < 10 * replayed[1]
    assert {p.name: p.read_text() for p in (tmp_path / "weights").glob("rank*.txt")} == clean_hashes
    a, b = final_weights(clean), final_weights(hit)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6


def test_a_spike_from_a_corrupted_window_rewinds_past_it_and_the_lineage_lists_it(trainer):
    micro = 8  # train.micro_batch_size on one process: step n reads samples [8(n-1), 8n)
    window = [13 * micro, 15 * micro]  # steps 14 and 15 read blocks of one repeated token
    run = ["train.steps=24", "train.warmup_steps=2", "train.sdc_interval=0"]
    spike = ["train.on_spike=rollback", "train.max_spikes=1", "train.loss_spike_factor=1.15"]
    # checkpoints every 5 steps: after the rollback to step 10, steps 15 and 20 are saved (step 20's
    # save waits for step 15's publish) and the process is killed as step 22 starts: the relaunch
    # resumes from a checkpoint saved after the rollback, which alone carries the window on
    relaunch = ["train.checkpoint_interval=5", "cluster.max_restarts=1"]
    with injected(corrupt_samples=window, kill_rank=0, kill_step=22):
        r = trainer.run(*run, *spike, *relaunch)
    rollback = events(r.metrics, "rollback")
    assert len(rollback) == 1 and rollback[0]["reason"] == "loss_spike" and "-step10-" in rollback[0]["to"]
    assert rollback[0]["skipped_samples"] == window
    assert [step for step, _ in rollback[0]["spikes"]] == [14, 15]  # the rewound history keeps what it saw
    starts = events(r.metrics, "start")
    assert len(starts) == 2 and starts[1]["step"] in (15, 20), starts
    assert f"-step{starts[1]['step']}-" in starts[1]["resumed_from"]
    # the model's lineage says which samples it never trained on, though the relaunch began after
    # the rollback (from a checkpoint's metadata); its loss curve has no spike
    model = trainer.store.manifest(r.model.ref)  # read back from the store
    assert model.metadata["skipped_samples"] == [window] and r.result.skipped_samples == [window]
    # every checkpoint saved after the rollback carries the window, before the relaunch and after it
    ckpts = {m.metadata["step"]: m.metadata for m in trainer.store.versions("checkpoint", "tiny")}
    assert {20, 24} <= set(ckpts), sorted(ckpts)  # retention keeps the newest
    assert {step: m["skipped_samples"] for step, m in ckpts.items() if step > 10} == {
        step: [window] for step in ckpts if step > 10
    }
    steps, _ = read_records(r.metrics)
    assert [s["step"] for s in steps] == list(range(1, 25))
    losses = [s["loss"] for s in steps]
    assert all(b < 1.15 * a for a, b in zip(losses, losses[1:], strict=False)), losses
    # the same with log: the spike is in the curve and nothing is skipped
    with injected(corrupt_samples=window):
        logged = Trainer(trainer.dataset_store, trainer.tmp / "logged").run(*run, *spike[1:], "train.on_spike=log")
    logged_losses = [s["loss"] for s in read_records(logged.metrics)[0]]
    assert logged_losses[13] > 1.15 * logged_losses[12] and logged.result.skipped_samples == []


def test_a_spike_with_halt_fails_the_stage_naming_the_step(trainer):
    with injected(corrupt_samples=[104, 112]), pytest.raises(LaunchError, match=r"loss spike: 1 step\(s\) .* step 14"):
        trainer.run("train.steps=16", "train.warmup_steps=2", "train.on_spike=halt", "train.loss_spike_factor=1.15",
                    "cluster.max_restarts=0")  # fmt: skip


def test_the_fingerprint_changes_with_one_bit_and_the_verdicts_name_who_was_wrong():
    import torch

    model = torch.nn.Linear(64, 64)
    before = sdc.fingerprint(model)
    with torch.no_grad():
        model.weight.view(-1)[7:8].view(torch.int32).bitwise_xor_(1)  # the lowest mantissa bit
    after = sdc.fingerprint(model)
    assert (before != after).tolist() == [True, False]
    a, b = (1, 2), (1, 3)
    assert sdc.judge([a, a]) is None
    assert sdc.judge([a, b, a]).culprits == [1]  # a majority names the odd one out
    assert sdc.judge([a, b]).how == "tie"  # two replicas: the replay decides
    # rank 1 is a bit flip away from the replayed value; rank 0 only by the noise it took in
    assert sdc.settle([[0.5 + 1e-9], [0.5 + 3e-5]], [0.5]).culprits == [1]
    assert sdc.settle([[0.5 + 3e-5], [0.5 + 1e-9]], [0.5]).culprits == [0]
    assert sdc.settle([[float("nan")], [0.5 + 1e-9]], [0.5]).culprits == [0]  # a NaN is far
    assert not sdc.settle([[0.5 + 1e-6], [0.5 + 2e-6]], [0.5]).settled  # neither clearly nearer


def test_gradient_outliers_are_high_low_or_non_finite_and_a_replay_reproduces_within_a_tolerance():
    nan = float("nan")
    assert sdc.grad_outliers([1.0, 1.2, 30.0]) == [2] and sdc.grad_outliers([1.0, 0.01, 1.1]) == [1]
    assert sdc.grad_outliers([1.0, nan, 1.1]) == [1] and sdc.grad_outliers([1.0, 1.5]) == []
    assert sdc.grad_outliers([1.0, nan]) == [0, 1]
    assert sdc.grad_outliers([100.0, 0.7]) == [0, 1]  # two ranks: both suspects
    assert sdc.grad_outliers([1.0, -1.0]) == []  # not measured on every rank
    assert sdc.reproduced(nan, nan) and sdc.reproduced(0.7, 0.7 * (1 + 1e-6)) and not sdc.reproduced(100.0, 0.7)
    assert not sdc.reproduced(nan, 0.7)


def test_skipped_windows_merge_and_the_sample_order_jumps_over_them():
    windows = guards.add_window([], 16, 24)
    windows = guards.add_window(windows, 8, 16)
    assert windows == [[8, 24]] and guards.add_window(windows, 40, 48) == [[8, 24], [40, 48]]
    assert [guards.past_skipped(s, 8, [[8, 24], [24, 32]]) for s in (0, 8, 20, 32)] == [0, 32, 32, 32]
    assert guards.past_skipped(4, 8, [[8, 24]]) == 24  # a micro-batch straddling the window's start


def test_the_device_guards_judge_against_the_recent_median_and_mask_the_optimizer_step():
    """Issue 40, point 6: the guards decide on the device, and the optimizer step is masked by
    their decision. (1) The ring's running median is `statistics.median` of the losses the host
    keeps (odd and even counts, after it wraps past RECENT); (2) a spike under `skip` and a
    non-finite step leave a real fused AdamW's weights and step count as they were, a spike under
    `log` and a plain step move them; (3) a skipped spike never joins the median."""
    import statistics

    import torch

    from components.config import defaults
    from components.optimizer import build_optimizer
    from components.train.optim import clip, masked_step

    def run(on_spike: str, losses: list[float]) -> tuple[list, list, list]:
        train = defaults("train", on_spike=on_spike, on_nonfinite="skip", loss_spike_factor=1.5, lr=0.1)
        g, model = guards.Guards(train), torch.nn.Linear(4, 4)
        optimizer = build_optimizer(model, train)
        medians, moved, expected = [], [], []
        for loss in losses:
            model(torch.ones(1, 4)).sum().backward()
            before = model.weight.detach().clone()
            t = torch.tensor(loss, dtype=torch.float64)
            d = g.decide(t, clip(model, optimizer, 1.0, None))
            masked_step(optimizer, d.stepped, None)
            g.join(t, d)
            if d.stepped or d.spike:
                g.stepped(loss, bool(d.spike))  # the host's list, as the loop's settling keeps it
            medians.append(float(d.median))
            expected.append(statistics.median(g.losses) if g.losses else float("nan"))
            moved.append((bool(d.spike), bool(d.stepped), not torch.equal(before, model.weight)))
        return medians, moved, expected

    losses = [2.0 + 0.002 * i + 0.01 * (i % 7) for i in range(63)]  # a trend: which 50 the ring holds matters
    medians, moved, expected = run("skip", [*losses[:12], 9.0, float("nan"), *losses[12:]])
    assert medians[1:] == pytest.approx(expected[:-1], rel=0, abs=1e-12)  # each step judged against those before it
    assert moved[12] == (True, False, False) and moved[13] == (False, False, False)  # spike, NaN: weights kept
    assert all(m == (False, True, True) for i, m in enumerate(moved) if i not in (12, 13))
    assert max(expected[12:]) < 2.2  # the skipped spike never joined the median
    _, logged, _ = run("log", [*losses[:12], 9.0])
    assert logged[12] == (True, True, True)  # a logged spike is applied
