"""Pipeline parallelism (torch.distributed.pipelining, as torchtitan applies it), each stage its
model family's `stage` (components/models/).

The blocks are cut into `pp x v` stages of consecutive blocks (v = 1 for 1F1B and GPipe, 2 for
interleaved 1F1B); stage s runs on pipeline rank s % pp ("loop" placement, so an interleaved
rank holds stages r and r + pp). The first stage also holds the embeddings, the last the final
norm and the head; tied embeddings are refused at compose (the two ends live on two ranks).

Every stage is a chunk whose parameter names are the full model's (for Llama `model.layers.5...`,
`lm_head.weight`): blocks sit in a ModuleDict keyed by their index in the whole model. A rank's
chunks are gathered under one `PipelineRank` module with those same names, which the optimizer,
DCP and the export see: a checkpoint saved by any pipeline layout loads into any other, and
into data parallelism. The chunks are wrapped one by one (activation checkpointing, compile,
FSDP2 over the data-parallel mesh) before the schedule drives them.

A step hands the schedule the data-parallel rank's whole batch (grad_accum_steps
micro-batches, in the sampler's order); it splits it into `pipeline_microbatches` (those
micro-batches, or pp equal parts when there are fewer than pp of them), runs
forward and backward through the stages and averages the gradients over them (scale_grads),
so one step equals the accumulated step of the other layouts. The loss is computed on the
last stage. Forward-only passes (validation, the probe, a non-finite replay) go stage by stage
with plain sends and receives and return the loss on every rank.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from components.config import PIPELINE_SCHEDULES
from components.model_math import stage_layers
from components.models import spec_of, token_loss
from components.parallel import pipeline_microbatches
from components.parallel.tensor import local_loss, loss_scope

SCHEDULE_CLASSES = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved_1f1b": "Interleaved1F1B"}  # pipelining's names


def stages_per_rank(schedule: str) -> int:
    return PIPELINE_SCHEDULES[schedule]


class PipelineRank(nn.Module):
    """This rank's stages as one module with the full model's parameter names (the optimizer,
    DCP and the export read it). Its forward is the pipeline's; `chunks` are not children."""

    def __init__(self, full: nn.Module, chunks: list[nn.Module], stage_ids: list[int], num_stages: int):
        super().__init__()
        self.config = full.config
        for chunk in chunks:
            for name, part in chunk.parts().items():
                _graft(self, name, part)
        self.chunks, self.stage_ids, self.num_stages = chunks, stage_ids, num_stages  # plain attributes

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.stage_ids


def _graft(root: nn.Module, name: str, module: nn.Module) -> None:
    """Put `module` at dotted `name` under `root`, making plain containers on the way."""
    *path, leaf = name.split(".")
    for part in path:
        if not hasattr(root, part):
            root.add_module(part, nn.Module())
        root = getattr(root, part)
    root.add_module(leaf, module)


def build_stages(
    model: nn.Module, pp_rank: int, pp: int, schedule: str, autocast: Callable
) -> tuple[list[nn.Module], list[int]]:
    """This rank's stage chunks (loop placement; each its family's `stage`, under the full
    model's names) and their stage indices."""
    if model.config.tie_word_embeddings:
        raise ValueError("train.pp > 1 needs model.tie_embeddings=false: the embeddings and the head are on two ranks")
    v = stages_per_rank(schedule)
    ranges = stage_layers(model.config.num_hidden_layers, pp * v)
    ids = [pp_rank + k * pp for k in range(v)]
    spec = spec_of(model)
    chunks = [spec.stage(model, ranges[s], s == 0, s == pp * v - 1, autocast) for s in ids]
    return chunks, ids


class Pipeline:
    """The schedule over this rank's stages, a training step through it, and forward-only loss."""

    def __init__(
        self, rank_module: PipelineRank, pp_mesh, device: torch.device, schedule: str, n_micro: int, chunk: int = 0
    ):
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import get_schedule_class

        self.module, self.device = rank_module, device
        self.group = pp_mesh.get_group()
        self.pp, self.pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
        self.ranks = dist.get_process_group_ranks(self.group)  # global rank of each pipeline rank
        n = rank_module.num_stages
        stages = [
            PipelineStage(c, s, n, device, group=self.group)
            for c, s in zip(rank_module.chunks, rank_module.stage_ids, strict=True)
        ]
        cls = get_schedule_class(SCHEDULE_CLASSES[schedule])
        self.schedule = cls(stages if stages_per_rank(schedule) > 1 else stages[0], n_microbatches=n_micro,
                            loss_fn=functools.partial(token_loss, chunk_tokens=chunk), scale_grads=True)  # fmt: skip

    @classmethod
    def of(cls, model: nn.Module, train, device: torch.device) -> Pipeline | None:
        """The schedule of a `PipelineRank` that `parallelize` built, or None for other layouts."""
        if not isinstance(model, PipelineRank):
            return None
        micro = pipeline_microbatches(train)[0]
        return cls(model, model.pp_mesh, device, train.pp_schedule, micro, train.loss_chunk_tokens)

    def step(self, batch: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one optimizer step's batch (split into the schedule's
        micro-batches, in order); the mean of their mean losses on the last stage's ranks, 0
        elsewhere."""
        inputs, targets = batch[:, :-1], batch[:, 1:]
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.module.has_first else ()
        target = targets if self.module.has_last else None
        # return_outputs=False: the last stage would keep every micro-batch's logits and join them
        with self.loss_scope():
            self.schedule.step(*args, target=target, losses=losses if self.module.has_last else None,
                               return_outputs=False)  # fmt: skip
        if not losses:
            return torch.zeros((), device=self.device)
        return torch.stack([local_loss(loss.detach()) for loss in losses]).mean()

    def loss_scope(self):
        """A loss-parallel head's loss (its logits split over the vocabulary) under
        `loss_parallel()`, forward and backward (components/parallel/tensor.py)."""
        return loss_scope(self.module.chunks[-1])

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        """The mean token loss of `batch` through every stage, forward only (no autograd graph
        kept), on every pipeline rank: hidden states go stage to stage with send/recv (dtype and
        length first: a stage's output dtype depends on the precision, and under sequence parallel
        its length is this tp rank's part of the sequence), the loss back from the last."""
        inputs, targets = batch[:, :-1], batch[:, 1:]
        chunks = dict(zip(self.module.stage_ids, self.module.chunks, strict=True))
        h = inputs
        n = self.module.num_stages
        with torch.no_grad(), self.loss_scope():
            for s in range(n):
                owner, nxt = s % self.pp, (s + 1) % self.pp
                if owner == self.pp_rank:
                    h = chunks[s](h)
                    if s < n - 1:
                        code = torch.tensor([_DTYPES.index(h.dtype), h.shape[1]], dtype=torch.int64)
                        dist.send(code.to(self.device), self.ranks[nxt], group=self.group)
                        dist.send(h.contiguous(), self.ranks[nxt], group=self.group)
                elif nxt == self.pp_rank and s < n - 1:
                    code = torch.zeros(2, dtype=torch.int64, device=self.device)
                    dist.recv(code, self.ranks[owner], group=self.group)
                    dtype, length = code.tolist()
                    shape = (inputs.shape[0], length, self.module.config.hidden_size)
                    h = torch.empty(shape, dtype=_DTYPES[dtype], device=self.device)
                    dist.recv(h, self.ranks[owner], group=self.group)
            loss = token_loss(h, targets) if self.module.has_last else torch.zeros((), device=self.device)
        out = local_loss(loss.detach()).float().reshape(1).clone()
        dist.broadcast(out, self.ranks[(n - 1) % self.pp], group=self.group)
        return out[0]


_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
