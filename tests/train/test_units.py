"""Unit tests of the training pieces: schedule, clipping, MFU, non-finite handling, sampler."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from components.config import defaults
from components.model_math import flops_per_token, mfu
from components.robust import leave_one_out_z
from components.train.data import BlockSampler, DataFitError
from components.train.nonfinite import first_nonfinite_module
from components.train.optim import clip_and_step, lr_at


def test_lr_schedule_warmup_then_cosine_to_min():
    cfg = defaults("train", lr=1.0, min_lr=0.1, warmup_steps=10, steps=110)
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(110, cfg) == pytest.approx(0.1) and lr_at(500, cfg) == pytest.approx(0.1)
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(10, 110))


def _model_with_grads(scale: float) -> torch.nn.Linear:
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 4)
    (m(torch.ones(2, 4)).sum() * scale).backward()
    return m


def test_clip_applies_to_unscaled_gradients():
    reference = _model_with_grads(1.0)
    true_norm = float(torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]))
    scaled = _model_with_grads(1024.0)  # as GradScaler(init_scale=1024) leaves them
    opt = torch.optim.SGD(scaled.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    norm, stepped = clip_and_step(scaled, opt, max_norm=true_norm / 2, scaler=scaler)
    assert stepped and norm == pytest.approx(true_norm, rel=1e-5)  # measured after unscale_, not 1024x


def test_clip_bounds_the_update():
    m = _model_with_grads(1.0)
    before = [p.detach().clone() for p in m.parameters()]
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    norm, stepped = clip_and_step(m, opt, max_norm=0.5, scaler=None)
    delta = torch.sqrt(sum(((p.detach() - b) ** 2).sum() for p, b in zip(m.parameters(), before, strict=True)))
    assert stepped and norm > 0.5 and float(delta) == pytest.approx(0.5, rel=1e-4)


def test_nonfinite_step_is_skipped_and_weights_kept():
    m = _model_with_grads(1.0)
    next(m.parameters()).grad[0, 0] = float("nan")
    before = [p.detach().clone() for p in m.parameters()]
    opt = torch.optim.AdamW(m.parameters(), lr=1.0)
    _, stepped = clip_and_step(m, opt, max_norm=1.0, scaler=None)
    assert not stepped
    assert all(torch.equal(p.detach(), b) for p, b in zip(m.parameters(), before, strict=True))
    assert all(p.grad is None for p in m.parameters())
    assert not opt.state  # AdamW moments untouched by the bad step


def test_nonfinite_step_backs_off_the_loss_scale():
    m = _model_with_grads(1.0)
    next(m.parameters()).grad[0, 0] = float("inf")
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    _, stepped = clip_and_step(m, torch.optim.SGD(m.parameters(), lr=1.0), max_norm=1.0, scaler=scaler)
    assert not stepped and scaler.get_scale() == 512.0


def test_first_nonfinite_module_is_named():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    with torch.no_grad():
        model[2].weight[0, 0] = float("nan")
    assert first_nonfinite_module(model, lambda: model(torch.ones(1, 4))) == "2"
    with torch.no_grad():
        model[2].weight[0, 0] = 0.0
    assert first_nonfinite_module(model, lambda: model(torch.ones(1, 4))) is None


def test_flops_per_token_matches_torch_flop_counter():
    """The formula against an independent count: torch's FlopCounterMode over a real forward and
    backward (SDPA's math backend, whose matmuls the counter sees; it counts full, non-causal
    attention, as the PaLM formula does)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from components.models import build_model, count_params

    cfg = defaults(
        "model", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, ffn_hidden_size=192
    )
    model = build_model(cfg, 512, seed=0)
    ids = torch.randint(0, 512, (2, 129))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        logits = model(input_ids=ids[:, :-1]).logits
        F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
    counted = counter.get_total_flops() / ids[:, :-1].numel()
    planned = flops_per_token(cfg, count_params(model, exclude_embeddings=True), seq_len=128)
    assert counted == pytest.approx(planned, rel=0.01)  # the formula also counts the norms' weights
    assert mfu(1e12 / planned, planned, 1.0, 1) == pytest.approx(1.0) and mfu(1.0, planned, None, 2) is None


def test_planned_selective_recompute_flops_are_what_backward_does_again():
    """The FLOPs selective checkpointing adds, counted by torch's FlopCounterMode over a real
    forward and backward against the same without checkpointing: only the matmuls the rule does
    not keep (k, o and up), exactly (the CPU's flash attention, which the rule keeps, is invisible
    to the counter either way)."""
    ac = "selective"
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from components.models import build_model
    from components.parallel.checkpointing import apply_activation_checkpointing
    from components.preflight.plan import plan

    cfg = defaults(
        "model", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=192
    )
    ids = torch.randint(0, 512, (2, 129))
    backend = SDPBackend.FLASH_ATTENTION

    def counted(mode: str) -> float:
        model = build_model(cfg, 512, seed=0)
        apply_activation_checkpointing(model, mode, 1)
        with sdpa_kernel(backend), FlopCounterMode(display=False) as counter:
            logits = model(input_ids=ids[:, :-1]).logits
            F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        return counter.get_total_flops() / ids[:, :-1].numel()

    again = counted(ac) - counted("off")
    planned = plan(cfg, defaults("train", activation_checkpointing=ac), 1, 128).recompute_flops_per_token
    assert again > 0 and again == pytest.approx(planned, rel=0.01)


def test_the_llama_forward_order_names_the_earliest_culprit_of_every_ranks():
    """A non-finite step's culprit is the earliest in the forward of every rank's own finding
    (embeddings, blocks by their index in the whole model, the final norm, the head); on a tie
    the lowest rank's."""
    from components.models import FAMILIES

    spec = FAMILIES["llama"]
    names = ["lm_head", "model.norm", "model.layers.10.mlp.down_proj", "model.layers.2.self_attn.q_proj",
             "model.embed_tokens"]  # fmt: skip
    assert sorted(names, key=spec.forward_position) == names[::-1]


def test_leave_one_out_z_flags_one_slow_rank_of_two():
    z = leave_one_out_z([0.10, 0.50])
    assert z[1] > 5 and z[0] < 0
    assert max(leave_one_out_z([0.100, 0.101, 0.099, 0.100])) < 5


class FakeBlocks:
    """Shards of consecutive integers: block j of shard s holds its global index."""

    def __init__(self, sizes: list[int]):
        self.sizes = sizes
        self.prefetched: list[int] = []

    def __len__(self) -> int:
        return sum(self.sizes)

    def block(self, s: int, j: int) -> np.ndarray:
        return np.array([sum(self.sizes[:s]) + j])

    def prefetch(self, s: int) -> None:
        self.prefetched.append(s)


def test_sampler_order_is_deterministic_sharded_and_independent_of_the_world_size():
    blocks = FakeBlocks([30, 0, 50, 20])  # an empty shard too
    a0 = BlockSampler(blocks, micro_batch=4, grad_accum=1, world=2, rank=0, seed=7)
    a1 = BlockSampler(blocks, micro_batch=4, grad_accum=1, world=2, rank=1, seed=7)
    one = BlockSampler(blocks, micro_batch=4, grad_accum=1, world=1, rank=0, seed=7)
    two_ranks = [i for s in range(0, 96, 8) for i in a0.indices(s) + a1.indices(s)]
    assert len(set(two_ranks)) == 96  # no block twice within an epoch, ranks disjoint
    assert two_ranks == [i for s in range(0, 96, 4) for i in one.indices(s)]  # same order on 1 rank
    # 2 ranks for 40 samples, then resumed on 1 rank at sample 40, across the epoch boundary
    uninterrupted = [i for s in range(0, 160, 4) for i in one.indices(s)]
    resumed = two_ranks[:40] + [i for s in range(40, 160, 4) for i in one.indices(s)]
    assert resumed == uninterrupted
    assert sorted(int(blocks.block(s, j)[0]) for s, j in uninterrupted[:100]) == list(range(100))  # an epoch
    runs = [s for k, (s, _) in enumerate(uninterrupted[:100]) if k == 0 or s != uninterrupted[k - 1][0]]
    assert sorted(runs) == [0, 2, 3]  # each shard read in one run per epoch, the empty one never
    assert uninterrupted[100:] != uninterrupted[:100]  # the next epoch is another order
    other_seed = BlockSampler(blocks, micro_batch=4, grad_accum=1, world=2, rank=0, seed=8)
    assert other_seed.indices(0) != a0.indices(0)


def test_the_sampler_prefetches_the_next_nonempty_shard_in_its_order():
    blocks = FakeBlocks([8, 0, 8, 8])
    sampler = BlockSampler(blocks, micro_batch=4, grad_accum=1, world=1, rank=0, seed=3)
    order = [sampler.locate(k)[0] for k in range(0, 24, 8)]  # shards in the epoch's order
    sampler.batch(0, torch.device("cpu"))
    assert blocks.prefetched == [order[1]] and 1 not in order


def test_sampler_refuses_data_smaller_than_one_step():
    with pytest.raises(DataFitError, match="= 64 blocks per step, but the train split has only 10"):
        BlockSampler(FakeBlocks([4, 6]), micro_batch=8, grad_accum=2, world=4, rank=0, seed=0)


def test_device_peaks_are_looked_up_by_name():
    from components.devices import peak_tflops

    assert peak_tflops("NVIDIA H200") == 989.4 and peak_tflops("NVIDIA H200", "fp8") == 1978.9
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0 and peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "fp8") is None and peak_tflops("Tesla T4") is None


def test_step_line_averages_throughput_over_the_interval_and_omits_mfu_on_cpu():
    from components.train.monitor import StepLine, step_text

    line = StepLine(steps=100, interval=2, flops_per_token=1e6, peak=None, world=2, device=torch.device("cpu"))
    rec = {"loss": 2.0, "grad_norm": 1.0, "lr": 1e-3, "peak_memory_bytes": 2**30}
    assert line.add({**rec, "step": 1, "step_s": 1.0, "tokens_per_s": 1000.0}) is None
    text = step_text(line.add({**rec, "step": 2, "step_s": 3.0, "tokens_per_s": 3000.0}))
    # 1000 + 9000 tokens in 4 s; 98 steps left at 2 s each
    assert "2,500 tokens/s" in text and "MFU" not in text and "ETA 0:03:16" in text and "mem 1.00 GiB" in text
    gpu_like = StepLine(steps=10, interval=1, flops_per_token=1e6, peak=1.0, world=2, device=torch.device("cpu"))
    assert "MFU 50.0%" in step_text(gpu_like.add({**rec, "step": 1, "step_s": 1.0, "tokens_per_s": 1e6}))


def test_train_refuses_a_verdict_that_did_not_pass():
    from components.train.stage import PreflightNotPassed, require_passing_verdict

    ok = {"passed": True, "healthy": ["a#0"], "unhealthy": {}}
    assert require_passing_verdict(ok) is ok
    with pytest.raises(PreflightNotPassed, match="b#1: slow GEMM"):
        require_passing_verdict({"passed": False, "healthy": ["a#0"], "unhealthy": {"b#1": ["slow GEMM"]}})
    with pytest.raises(PreflightNotPassed):
        require_passing_verdict({"healthy": ["a#0"]})  # no verdict at all is not a pass


def test_a_checkpoint_missing_another_ranks_shard_does_not_verify(tmp_path):
    """What one node of a multi-node run holds on its own disk: its shards and the index of
    every rank's; it is not a checkpoint until the other ranks' files are fetched."""
    from components import checkpoint_format as ckpt

    for rank in (0, 1):
        (tmp_path / f"__{rank}_0.distcp").write_bytes(bytes([rank]) * 64)
    names = ckpt.own_files(tmp_path, 0) + ckpt.own_files(tmp_path, 1)
    assert names == ["__0_0.distcp", "__1_0.distcp"]
    ckpt.write_index(tmp_path, ckpt.index_bytes(ckpt.file_entries(tmp_path, names), {"step": 10}))
    assert ckpt.verify(tmp_path) == {"step": 10}
    (tmp_path / "__1_0.distcp").unlink()
    with pytest.raises(ckpt.CheckpointError, match="__1_0.distcp: missing"):
        ckpt.verify(tmp_path)


def test_periodic_validation_runs_every_interval_and_at_the_last_step():
    from components.train.worker import validates_at

    assert [s for s in range(1, 51) if validates_at(s, 20, 50)] == [20, 40, 50]
    assert [s for s in range(1, 41) if validates_at(s, 20, 40)] == [20, 40]
    assert not any(validates_at(s, 0, 50) for s in range(1, 51))  # 0: off


@pytest.fixture
def one_process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_resumed_run_keeps_one_tensorboard_event_file_with_each_step_once(tmp_path, one_process_group):
    """A run crashes after step 8 (its last checkpoint: step 5); the rerun resumes from step 5.
    The run directory keeps one event file: steps 1-5 of the first attempt, 6-12 of the rerun."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from components.plots import read_timeline
    from components.train.monitor import Monitor
    from components.train.worker import validates_at

    def attempt(first: int, last: int, offset: float) -> None:
        monitor = Monitor(tmp_path / "run", 0, 1, straggler_z=5.0)
        for step in range(first, last + 1):
            monitor.log_step({"step": step, "loss": step + offset, "stepped": True, "forward_s": 0.1, "time": 1e9})
            if validates_at(step, 5, 12):
                monitor.log_val(step, 100 + step + offset, 32, 0.01)
        monitor.close()

    attempt(1, 8, 0.0)
    attempt(6, 12, 0.5)
    files = list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 1, files
    scalars = EventAccumulator(str(files[0])).Reload()
    train = [(e.step, e.value) for e in scalars.Scalars("train/loss")]
    assert train == [(s, s + (0.5 if s > 5 else 0.0)) for s in range(1, 13)]
    assert [(e.step, e.value) for e in scalars.Scalars("val/loss")] == [(5, 105.0), (10, 110.5), (12, 112.5)]
    steps, vals = read_timeline(tmp_path / "run" / "metrics.jsonl")  # the report reads the same timeline
    assert [s["loss"] for s in steps] == [v for _, v in train] and [v["step"] for v in vals] == [5, 10, 12]
