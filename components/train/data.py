"""Deterministic, rank-sharded batches of token blocks whose position is checkpointed: one
source, or a mixture of sources drawn by weight."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from components.prelaunch import DataFitError
from components.stream import StreamingBlocks

# The mixture's schedule: sample k draws the source whose weight interval holds the fractional
# part of k·(golden ratio), in 64-bit fixed point (the same integers on every rank and machine).
GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / golden ratio, odd
CHUNK = 1 << 22  # samples counted per vector when a rank moves far along the schedule
WINDOW = 1 << 12  # samples of the schedule a rank computes at once


@dataclass(frozen=True)
class Mixture:
    """The sources of a dataset (each a set of its shards), their weights (normalised) and
    their caps on passes over their blocks (None: no cap)."""

    names: tuple[str, ...]
    weights: tuple[float, ...]
    shards: tuple[tuple[int, ...], ...]  # the dataset's shard indices per source
    max_epochs: tuple[float | None, ...]

    @classmethod
    def single(cls, blocks: StreamingBlocks) -> Mixture:
        return cls(("all",), (1.0,), (tuple(range(len(blocks.sizes))),), (None,))

    @classmethod
    def of(cls, blocks: StreamingBlocks, weights: dict[str, float], max_epochs: dict | None = None) -> Mixture:
        """The sources the dataset's shard rows name, in `weights`' order."""
        named = [row["source"] for row in blocks.shards]
        missing = sorted(set(weights) - set(named))
        if missing:
            raise DataFitError(f"data.mixture names {', '.join(missing)}, which the dataset does not hold: {named}")
        shards = tuple(tuple(i for i, n in enumerate(named) if n == name) for name in weights)
        caps = tuple((max_epochs or {}).get(n) for n in weights)
        total = sum(weights.values())
        return cls(tuple(weights), tuple(w / total for w in weights.values()), shards, caps)

    def thresholds(self) -> np.ndarray:
        """The upper end of each source's interval of [0, 2^64), as uint64 (the last is the top)."""
        ends = np.cumsum(self.weights)
        edges = [min(int(e * 2.0**64), 2**64 - 1) for e in ends[:-1]]
        return np.array([*edges, 2**64 - 1], dtype=np.uint64)


class _SourceOrder:
    """One source's blocks in a deterministic order: pass e visits its shards in the order
    `perm(key, e)` and each shard's blocks in the order `perm(key, e, shard)`."""

    def __init__(self, sizes: np.ndarray, shards: tuple[int, ...], key: list[int]):
        self.shards = np.asarray(shards, dtype=np.int64)
        self.sizes = np.asarray(sizes, dtype=np.int64)[self.shards] if len(shards) else np.zeros(0, np.int64)
        self.total = int(self.sizes.sum())
        self.key = key
        self._epoch = -1
        self._perms: dict[int, np.ndarray] = {}

    def _enter(self, epoch: int) -> None:
        if epoch != self._epoch:
            self._order = np.random.default_rng([*self.key, epoch]).permutation(len(self.sizes))
            self._ends = np.cumsum(self.sizes[self._order])  # where each visited shard ends
            self._epoch, self._perms, self._following = epoch, {}, None

    def locate(self, n: int) -> tuple[int, int]:
        """(dataset shard, block) of this source's n-th draw."""
        self._enter(n // self.total)
        pos = n % self.total
        visit = int(np.searchsorted(self._ends, pos, side="right"))
        local = int(self._order[visit])
        if local not in self._perms:
            if len(self._perms) >= 2:  # a micro-batch spans at most two shards of a source
                self._perms.clear()
            rng = np.random.default_rng([*self.key, self._epoch, int(self.shards[local])])
            self._perms[local] = rng.permutation(self.sizes[local])
        start = int(self._ends[visit] - self.sizes[local])
        return int(self.shards[local]), int(self._perms[local][pos - start])

    def next_shard(self, n: int) -> int:
        """The dataset shard read after the one holding draw `n` (the one to prefetch)."""
        self._enter(n // self.total)
        visit = int(np.searchsorted(self._ends, n % self.total, side="right"))
        for s in self._order[visit + 1 :]:  # an empty shard is never read
            if self.sizes[s] > 0:
                return int(self.shards[s])
        if self._following is None:  # the pass's last shard: the next pass's first (once per pass)
            following = np.random.default_rng([*self.key, self._epoch + 1]).permutation(len(self.sizes))
            self._following = int(next(self.shards[s] for s in following if self.sizes[s] > 0))
        return self._following


class _Counts:
    """Draws per source before a global sample, counted forward from the last one asked for."""

    def __init__(self, sampler: BlockSampler, n: int):
        self.sampler, self.cursor, self.counts = sampler, 0, np.zeros(n, dtype=np.int64)

    def before(self, sample: int) -> np.ndarray:
        if sample < self.cursor:  # moved back (a rollback): count again from the start
            self.cursor, self.counts = 0, np.zeros_like(self.counts)
        while self.cursor < sample:
            stop = min(sample, self.cursor + CHUNK)
            self.counts += np.bincount(self.sampler.sources(self.cursor, stop), minlength=len(self.counts))
            self.cursor = stop
        return self.counts.copy()


class BlockSampler:
    """One global sample order over (source, shard, block), the same whatever the world size.

    One source: epoch e visits the shards in the order `perm(seed, e)` and each shard's blocks
    in the order `perm(seed, e, shard)`; sample k of the run is the (k mod N)-th of epoch k // N
    (N train blocks). A mixture: sample k draws source i when frac(k·φ⁻¹) falls in i's
    interval of the weights (a low-discrepancy schedule: after any k samples each source has
    its weight's share within a few samples, far inside the binomial tolerance), and takes
    that source's next block in its own order of the same kind (its passes counted on its own).

    All ranks read near the same global position, so a node needs the shard being read and
    the next one (prefetched), never the whole dataset. A micro-batch starting at global sample
    s gives rank r the samples [s + r·M, s + (r+1)·M) (M micro batch), and the run moves on by
    M·W samples (W world size). The checkpoint keeps s, so a run resumed on another number of
    ranks continues with exactly the next samples, and `drawn(s)` is what each source gave.
    """

    def __init__(
        self,
        blocks: StreamingBlocks,
        micro_batch: int,
        grad_accum: int,
        world: int,
        rank: int,
        seed: int,
        mixture: Mixture | None = None,
    ):
        per_step = micro_batch * grad_accum * world
        if len(blocks) < per_step:
            raise DataFitError(
                f"train.micro_batch_size={micro_batch} x train.grad_accum_steps={grad_accum} x world size {world} "
                f"= {per_step} blocks per step, but the train split has only {len(blocks)} blocks"
            )
        self.blocks, self.micro, self.world, self.rank, self.seed = blocks, micro_batch, world, rank, seed
        self.mixture = mixture or Mixture.single(blocks)
        # each source's shard stays open while the others are read (twice as many: the oldest opened,
        # the one closed, is then a source's previous shard, not another's current one)
        blocks.max_open = 1 if len(self.mixture.names) == 1 else 2 * len(self.mixture.names)
        many = len(self.mixture.names) > 1
        self._orders = [
            _SourceOrder(np.asarray(blocks.sizes), shards, [seed, i] if many else [seed])
            for i, shards in enumerate(self.mixture.shards)
        ]
        for name, order, w in zip(self.mixture.names, self._orders, self.mixture.weights, strict=True):
            if w > 0 and order.total == 0:
                raise DataFitError(f"data.mixture: source {name} has weight {w:.3g} but no train blocks")
        self._thresholds = self.mixture.thresholds()
        self._capped = any(c is not None for c in self.mixture.max_epochs)
        self._reading = _Counts(self, len(self._orders))  # where the batches are
        self._recorded = _Counts(self, len(self._orders))  # where the records are (they trail)
        self._w0, self._wsrc, self._wcum = 0, [], None  # the schedule's window (`_fill_window`)

    @property
    def samples_per_micro_batch(self) -> int:
        """Global samples one micro-batch of every rank consumes."""
        return self.micro * self.world

    def sources(self, start: int, stop: int) -> np.ndarray:
        """The source index of each global sample in [start, stop)."""
        if len(self._orders) == 1:
            return np.zeros(max(stop - start, 0), dtype=np.int64)
        frac = np.arange(start, stop, dtype=np.uint64) * np.uint64(GOLDEN)  # arrays wrap mod 2^64, silently
        src = np.searchsorted(self._thresholds, frac, side="right")  # the first interval ending above
        return np.minimum(src, len(self._orders) - 1).astype(np.int64)  # frac = 2^64 - 1: the last

    def drawn(self, sample: int) -> dict[str, int]:
        """Samples each source gave to global samples [0, sample)."""
        return dict(zip(self.mixture.names, (int(c) for c in self._recorded.before(sample)), strict=True))

    def locate_many(self, start: int, stop: int) -> list[tuple[int, int]]:
        """(shard, block) of the global samples [start, stop)."""
        return [self._orders[src].locate(n) for src, n in self._draws(start, stop)]

    def _draws(self, start: int, stop: int) -> list[tuple[int, int]]:
        """(source, its draw number) of the global samples [start, stop), capped."""
        if len(self._orders) == 1:  # one source: sample k is its k-th draw
            out = [(0, k) for k in range(start, stop)]
        else:
            if not self._w0 <= start or stop > self._w0 + len(self._wsrc):
                self._fill_window(start, stop)
            i = start - self._w0
            counts, out = self._wcum[i].tolist(), []
            for src in self._wsrc[i : i + stop - start]:
                out.append((src, counts[src]))
                counts[src] += 1
        if self._capped:
            for src, n in out:
                self._checked(src, n)
        return out

    def _fill_window(self, start: int, stop: int) -> None:
        """The schedule from `start` for WINDOW samples (or to `stop`): each one's source, and
        the draws per source before each (a batch then costs a slice, not a vector op)."""
        base = self._reading.before(start)
        srcs = self.sources(start, max(stop, start + WINDOW))
        cum = np.zeros((len(srcs) + 1, len(base)), dtype=np.int64)
        np.cumsum(np.eye(len(base), dtype=np.int64)[srcs], axis=0, out=cum[1:])
        self._w0, self._wsrc, self._wcum = start, srcs.tolist(), cum + base

    def locate(self, sample: int) -> tuple[int, int]:
        """(shard, block) of global sample `sample`."""
        return self.locate_many(sample, sample + 1)[0]

    def _checked(self, src: int, n: int) -> None:
        cap = self.mixture.max_epochs[src]
        if cap is not None and n >= cap * self._orders[src].total:
            total = self._orders[src].total
            name = self.mixture.names[src]
            raise DataFitError(
                f"data.sources.{name}.max_epochs={cap:g}: the run reached draw {n + 1} of source {name}, "
                f"which has {total} train blocks ({cap:g} passes = {int(cap * total)} draws)"
            )

    def next_shard(self, sample: int) -> int:
        """The shard read after the one holding global sample `sample` (the one to prefetch)."""
        if len(self._orders) == 1:
            return self._orders[0].next_shard(sample)
        src = int(self.sources(sample, sample + 1)[0])
        n = int(self._reading.before(sample)[src])
        return self._orders[src].next_shard(n)

    def indices(self, sample: int) -> list[tuple[int, int]]:
        """This rank's (shard, block) pairs for the micro-batch that starts at global sample `sample`."""
        start = sample + self.rank * self.micro
        return self.locate_many(start, start + self.micro)

    def batch(self, sample: int, device: torch.device) -> torch.Tensor:
        """(micro, block_len) int64 token ids for the micro-batch starting at global sample `sample`."""
        start = sample + self.rank * self.micro
        draws = self._draws(start, start + self.micro)
        rows = np.stack([self.blocks.block(*self._orders[src].locate(n)) for src, n in draws]).astype(np.int64)
        src, n = draws[-1]
        self.blocks.prefetch(self._orders[src].next_shard(n))  # after the shard of the batch's last sample
        return torch.from_numpy(rows).to(device, non_blocking=True)
