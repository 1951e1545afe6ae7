"""Deterministic, rank-sharded batches of token blocks whose position is checkpointed."""

from __future__ import annotations

import numpy as np
import torch

from components.blocks import TokenBlocks
from components.train.prelaunch import DataFitError


class BlockSampler:
    """One global sample order, the same whatever the world size: sample k of the run is
    block `perm(seed, epoch=k // N)[k % N]` of the N train blocks. A micro-batch starting at
    global sample s gives rank r the samples [s + r·M, s + (r+1)·M) (M micro batch), and the
    run moves on by M·W samples (W world size). The checkpoint keeps s, so a run resumed on
    another number of ranks continues with exactly the next samples, none repeated or skipped."""

    def __init__(self, blocks: TokenBlocks, micro_batch: int, grad_accum: int, world: int, rank: int, seed: int):
        per_step = micro_batch * grad_accum * world
        if len(blocks) < per_step:
            raise DataFitError(
                f"train.micro_batch_size={micro_batch} x train.grad_accum_steps={grad_accum} x world size {world} "
                f"= {per_step} blocks per step, but the train split has only {len(blocks)} blocks"
            )
        self.blocks, self.micro, self.world, self.rank, self.seed = blocks, micro_batch, world, rank, seed
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    @property
    def samples_per_micro_batch(self) -> int:
        """Global samples one micro-batch of every rank consumes."""
        return self.micro * self.world

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.blocks))
            self._perm_epoch = epoch
        return self._perm

    def indices(self, sample: int) -> list[int]:
        """This rank's block indices for the micro-batch that starts at global sample `sample`."""
        start = sample + self.rank * self.micro
        return [int(self._order(k // len(self.blocks))[k % len(self.blocks)]) for k in range(start, start + self.micro)]

    def batch(self, sample: int, device: torch.device) -> torch.Tensor:
        """(micro, block_len) int64 token ids for the micro-batch starting at global sample `sample`."""
        rows = np.stack([self.blocks[i] for i in self.indices(sample)]).astype(np.int64)
        return torch.from_numpy(rows).to(device, non_blocking=True)
