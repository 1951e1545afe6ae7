"""Deterministic, rank-sharded batches of token blocks whose position is checkpointed."""

from __future__ import annotations

import numpy as np
import torch

from components.prelaunch import DataFitError
from components.stream import StreamingBlocks


class BlockSampler:
    """One global sample order over (shard, block), the same whatever the world size.

    Epoch e visits the shards in the order `perm(seed, e)` and each shard's blocks in the
    order `perm(seed, e, shard)`; sample k of the run is the (k mod N)-th of epoch k // N
    (N train blocks). All ranks read near the same global position, so a node needs the
    shard being read and the next one (prefetched), never the whole dataset. A micro-batch
    starting at global sample s gives rank r the samples [s + r·M, s + (r+1)·M) (M micro
    batch), and the run moves on by M·W samples (W world size). The checkpoint keeps s, so
    a run resumed on another number of ranks continues with exactly the next samples.
    """

    def __init__(self, blocks: StreamingBlocks, micro_batch: int, grad_accum: int, world: int, rank: int, seed: int):
        per_step = micro_batch * grad_accum * world
        if len(blocks) < per_step:
            raise DataFitError(
                f"train.micro_batch_size={micro_batch} x train.grad_accum_steps={grad_accum} x world size {world} "
                f"= {per_step} blocks per step, but the train split has only {len(blocks)} blocks"
            )
        self.blocks, self.micro, self.world, self.rank, self.seed = blocks, micro_batch, world, rank, seed
        self._sizes = np.asarray(blocks.sizes, dtype=np.int64)
        self._epoch = -1
        self._shard_perms: dict[int, np.ndarray] = {}

    @property
    def samples_per_micro_batch(self) -> int:
        """Global samples one micro-batch of every rank consumes."""
        return self.micro * self.world

    def _enter_epoch(self, epoch: int) -> None:
        if epoch != self._epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(len(self._sizes))
            self._ends = np.cumsum(self._sizes[self._order])  # global position where each visited shard ends
            self._epoch, self._shard_perms = epoch, {}

    def locate(self, sample: int) -> tuple[int, int]:
        """(shard, block) of global sample `sample`."""
        n = len(self.blocks)
        self._enter_epoch(sample // n)
        pos = sample % n
        visit = int(np.searchsorted(self._ends, pos, side="right"))
        shard = int(self._order[visit])
        if shard not in self._shard_perms:
            if len(self._shard_perms) >= 2:  # a micro-batch spans at most two shards
                self._shard_perms.clear()
            rng = np.random.default_rng([self.seed, self._epoch, shard])
            self._shard_perms[shard] = rng.permutation(self._sizes[shard])
        start = int(self._ends[visit] - self._sizes[shard])
        return shard, int(self._shard_perms[shard][pos - start])

    def next_shard(self, sample: int) -> int:
        """The shard read after the one holding global sample `sample` (the one to prefetch)."""
        n = len(self.blocks)
        self._enter_epoch(sample // n)
        visit = int(np.searchsorted(self._ends, sample % n, side="right"))
        for s in self._order[visit + 1 :]:  # an empty shard is never read
            if self._sizes[s] > 0:
                return int(s)
        following = np.random.default_rng([self.seed, self._epoch + 1]).permutation(len(self._sizes))
        return int(next(s for s in following if self._sizes[s] > 0))  # the epoch's last shard: the next's first

    def indices(self, sample: int) -> list[tuple[int, int]]:
        """This rank's (shard, block) pairs for the micro-batch that starts at global sample `sample`."""
        start = sample + self.rank * self.micro
        return [self.locate(k) for k in range(start, start + self.micro)]

    def batch(self, sample: int, device: torch.device) -> torch.Tensor:
        """(micro, block_len) int64 token ids for the micro-batch starting at global sample `sample`."""
        pairs = self.indices(sample)
        rows = np.stack([self.blocks.block(s, j) for s, j in pairs]).astype(np.int64)
        self.blocks.prefetch(self.next_shard(sample + self.rank * self.micro + self.micro - 1))
        return torch.from_numpy(rows).to(device, non_blocking=True)
