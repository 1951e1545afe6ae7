"""The layout of the world as four degrees, and every size and rank derived from them.

`ParallelDims(dp_replicate, dp_shard, tp, pp)`: the world is pp pipeline ranks (outermost: a
stage's ranks are consecutive, a node's GPUs); in each, dp_replicate x dp_shard data-parallel
ranks; in each of those, tp consecutive ranks splitting each block's matmuls. dp_shard > 1 is
FSDP2 (HSDP with dp_replicate > 1 too); dp_shard == 1 with dp_replicate > 1 is DDP. Rank r is
pipeline rank r // (dp x tp), data-parallel rank (r // tp) % dp, tp rank r % tp, where
dp = dp_replicate x dp_shard (the mesh's dimensions give the pipeline and tp coordinates; the
sampler asks `dp_rank`).

This module is the only place that divides the world by a degree (tests/test_layout.py holds
the rest of the project to it): the trainer, the sampler, precision recipes, the config rules
and the planner ask a `ParallelDims` for a size or a rank.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1

    @classmethod
    def of(cls, train, world: int) -> ParallelDims:
        """The degrees a `train` config asks for on `world` ranks: `train.parallelism` (ddp or
        fsdp) says which data-parallel degree fills what tp x pp leave (dp_replicate under ddp,
        dp_shard under fsdp, beside `train.dp_replicate` replicas for HSDP). A world the other
        degrees do not divide is refused by the config rules before anything builds this."""
        dp = max(1, data_parallel(world, train.tp, train.pp))
        if str(getattr(train.parallelism, "value", train.parallelism)) == "fsdp":
            return cls(train.dp_replicate, max(1, dp // train.dp_replicate), train.tp, train.pp)
        return cls(dp, 1, train.tp, train.pp)

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: replicas that read different samples (tp and pp peers read the same)."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> bool:
        """Parameters sharded over the data-parallel ranks (FSDP2, or HSDP with replicas)."""
        return self.dp_shard > 1

    @property
    def ddp(self) -> bool:
        """Whole replicas under DDP: data parallelism without sharding."""
        return self.dp_shard == 1 and self.dp_replicate > 1

    def dp_rank(self, rank: int) -> int:
        return (rank // self.tp) % self.dp

    def loss_holders(self) -> int:
        """Ranks that hold the step's loss: every rank of the last pipeline stage."""
        return self.dp * self.tp

    def mesh(self, device_type: str):
        """One DeviceMesh over the world, a dimension per degree above 1 (pp, dp_replicate,
        dp_shard, tp, outermost first), or None for one process."""
        from torch.distributed.device_mesh import init_device_mesh

        dims = [("pp", self.pp), ("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard), ("tp", self.tp)]
        dims = [(name, n) for name, n in dims if n > 1]
        if not dims:
            return None
        return init_device_mesh(device_type, tuple(n for _, n in dims), mesh_dim_names=tuple(name for name, _ in dims))


def data_parallel(world: int, tp: int = 1, pp: int = 1) -> int:
    """The data-parallel ranks of `world` ranks split tp x pp ways (a layout being searched;
    a config's: `ParallelDims.of(train, world).dp`)."""
    return world // (tp * pp)


def pipeline_microbatches(train) -> tuple[int, int]:
    """(micro-batches, sequences each) the pipeline schedule runs per step on one data-parallel
    rank. The step's batch is micro_batch_size x grad_accum_steps sequences whatever the layout;
    under pipeline parallelism it flows through the stages as grad_accum_steps micro-batches, or,
    when there are fewer of them than stages, split into pp micro-batches (as torchtitan splits its
    local batch), so that every stage has work. Without pipeline parallelism: the micro-batches."""
    mbs, accum, pp = train.micro_batch_size, train.grad_accum_steps, train.pp
    if pp == 1 or accum >= pp:
        return accum, mbs
    return pp, mbs * accum // pp


def sequence_parallel(train, tied: bool, cuda: bool) -> bool:
    """Whether TP runs sequence parallel and a loss-parallel head (`train.sequence_parallel`):
    only with tp > 1, an untied head (a tied one is the embedding, computed whole), and for fp8
    only on CUDA (the fp8 casts before SP's all-gathers need fp8 collectives, which gloo has
    not). Under pipeline parallelism a stage hands its tp rank's part of the sequence on."""
    fp8 = str(getattr(train.precision, "value", train.precision)) == "fp8"
    return bool(train.sequence_parallel) and train.tp > 1 and not tied and (cuda or not fp8)
