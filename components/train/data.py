"""Deterministic, rank-sharded batches of token blocks whose position is checkpointed."""

from __future__ import annotations

import numpy as np
import torch

from components.tokenize.blocks import TokenBlocks
from components.train.inputs import DataFitError


class BlockSampler:
    """Global micro-batch p takes positions [p·M·W, (p+1)·M·W) of an epoch's permutation
    (M micro batch, W world size); rank r takes its M of them. The permutation of epoch e
    is seeded by (seed, e), so the whole order follows from (seed, position): resuming at
    the saved position continues with exactly the next blocks."""

    def __init__(self, blocks: TokenBlocks, micro_batch: int, grad_accum: int, world: int, rank: int, seed: int):
        per_step = micro_batch * grad_accum * world
        if len(blocks) < per_step:
            raise DataFitError(
                f"train.micro_batch_size={micro_batch} x train.grad_accum_steps={grad_accum} x world size {world} "
                f"= {per_step} blocks per step, but the train split has only {len(blocks)} blocks"
            )
        self.blocks, self.micro, self.world, self.rank, self.seed = blocks, micro_batch, world, rank, seed
        self.per_epoch = len(blocks) - len(blocks) % (micro_batch * world)  # every rank gets equal shares
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.blocks))[: self.per_epoch]
            self._perm_epoch = epoch
        return self._perm

    def indices(self, position: int) -> list[int]:
        start = (position * self.world + self.rank) * self.micro
        out = []
        for k in range(start, start + self.micro):
            epoch, offset = divmod(k, self.per_epoch)
            out.append(int(self._order(epoch)[offset]))
        return out

    def batch(self, position: int, device: torch.device) -> torch.Tensor:
        """(micro, block_len) int64 token ids for global micro-batch `position`."""
        rows = np.stack([self.blocks[i] for i in self.indices(position)]).astype(np.int64)
        return torch.from_numpy(rows).to(device, non_blocking=True)
