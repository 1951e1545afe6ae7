"""Pipeline parallelism (torch.distributed.pipelining, as torchtitan applies it) on the Llama decoder.

The blocks are cut into `pp x v` stages of consecutive blocks (v = 1 for 1F1B and GPipe, 2 for
interleaved 1F1B); stage s runs on pipeline rank s % pp ("loop" placement, so an interleaved
rank holds stages r and r + pp). The first stage also holds the embeddings, the last the final
norm and the head; tied embeddings are refused at compose (the two ends live on two ranks).

Every stage is a `StageChunk` whose parameter names are the full model's (`model.layers.5...`,
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

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from components.config import PIPELINE_SCHEDULES
from components.model_math import stage_layers
from components.parallel import pipeline_microbatches

SCHEDULE_CLASSES = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved_1f1b": "Interleaved1F1B"}  # pipelining's names


def stages_per_rank(schedule: str) -> int:
    return PIPELINE_SCHEDULES[schedule]


class StageChunk(nn.Module):
    """One pipeline stage of a `LlamaForCausalLM`: a run of its blocks (the embeddings before
    them on the first stage; the final norm and the head after them on the last), under the
    full model's parameter names. In: token ids (first stage) or hidden states; out: hidden
    states, or the logits on the last stage."""

    def __init__(self, full: nn.Module, layers: range, first: bool, last: bool, autocast: Callable):
        super().__init__()
        self.first, self.last, self.config, self._autocast = first, last, full.config, autocast
        self.model = nn.Module()
        if first:
            self.model.embed_tokens = full.model.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): full.model.layers[i] for i in layers})
        if last:
            self.model.norm = full.model.norm
            self.lm_head = full.lm_head
        self.model.rotary_emb = full.model.rotary_emb  # buffers only (not saved)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        with self._autocast():
            h = self.model.embed_tokens(x) if self.first else x
            positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
            rotary = self.model.rotary_emb(h, position_ids=positions)
            mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None,
                                      past_key_values=None, position_ids=positions)  # fmt: skip
            for block in self.model.layers.values():
                h = block(h, attention_mask=mask, position_embeddings=rotary, position_ids=positions)
            if self.last:
                return self.lm_head(self.model.norm(h))
            return h


class PipelineRank(nn.Module):
    """This rank's stages as one module with the full model's parameter names (the optimizer,
    DCP and the export read it). Its forward is the pipeline's; `chunks` are not children."""

    def __init__(self, full: nn.Module, chunks: list[StageChunk], stage_ids: list[int], num_stages: int):
        super().__init__()
        self.config = full.config
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict()
        for chunk in chunks:
            for key, block in chunk.model.layers.items():
                self.model.layers[key] = block
            if chunk.first:
                self.model.embed_tokens = chunk.model.embed_tokens
            if chunk.last:
                self.model.norm, self.lm_head = chunk.model.norm, chunk.lm_head
        self.chunks, self.stage_ids, self.num_stages = chunks, stage_ids, num_stages  # plain attributes

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.stage_ids


def build_stages(
    model: nn.Module, pp_rank: int, pp: int, schedule: str, autocast: Callable
) -> tuple[list[StageChunk], list[int]]:
    """This rank's stage chunks (loop placement) and their stage indices."""
    if model.config.tie_word_embeddings:
        raise ValueError("train.pp > 1 needs model.tie_embeddings=false: the embeddings and the head are on two ranks")
    v = stages_per_rank(schedule)
    ranges = stage_layers(model.config.num_hidden_layers, pp * v)
    ids = [pp_rank + k * pp for k in range(v)]
    chunks = [StageChunk(model, ranges[s], s == 0, s == pp * v - 1, autocast) for s in ids]
    return chunks, ids


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean token cross-entropy (the schedule's loss_fn on the last stage; micro_loss's too)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class Pipeline:
    """The schedule over this rank's stages, a training step through it, and forward-only loss."""

    def __init__(self, rank_module: PipelineRank, pp_mesh, device: torch.device, schedule: str, n_micro: int):
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
                            loss_fn=token_loss, scale_grads=True)  # fmt: skip

    @classmethod
    def of(cls, model: nn.Module, train, device: torch.device) -> Pipeline | None:
        """The schedule of a `PipelineRank` that `parallelize` built, or None for other layouts."""
        if not isinstance(model, PipelineRank):
            return None
        return cls(model, model.pp_mesh, device, train.pp_schedule, pipeline_microbatches(train)[0])

    def step(self, batch: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one optimizer step's batch (split into the schedule's
        micro-batches, in order); the mean of their mean losses on the last stage's ranks, 0
        elsewhere."""
        inputs, targets = batch[:, :-1], batch[:, 1:]
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.module.has_first else ()
        target = targets if self.module.has_last else None
        # return_outputs=False: the last stage would keep every micro-batch's logits and join them
        self.schedule.step(*args, target=target, losses=losses if self.module.has_last else None, return_outputs=False)
        if not losses:
            return torch.zeros((), device=self.device)
        return torch.stack([loss.detach() for loss in losses]).mean()

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        """The mean token loss of `batch` through every stage, forward only (no autograd graph
        kept), on every pipeline rank: hidden states go stage to stage with send/recv (dtype
        first: a stage's output dtype depends on the precision), the loss back from the last."""
        inputs, targets = batch[:, :-1], batch[:, 1:]
        chunks = dict(zip(self.module.stage_ids, self.module.chunks, strict=True))
        h = inputs
        n = self.module.num_stages
        with torch.no_grad():
            for s in range(n):
                owner, nxt = s % self.pp, (s + 1) % self.pp
                if owner == self.pp_rank:
                    h = chunks[s](h)
                    if s < n - 1:
                        code = torch.tensor([_DTYPES.index(h.dtype)], dtype=torch.int64)
                        dist.send(code.to(self.device), self.ranks[nxt], group=self.group)
                        dist.send(h.contiguous(), self.ranks[nxt], group=self.group)
                elif nxt == self.pp_rank and s < n - 1:
                    code = torch.zeros(1, dtype=torch.int64, device=self.device)
                    dist.recv(code, self.ranks[owner], group=self.group)
                    shape = (*inputs.shape, self.module.config.hidden_size)
                    h = torch.empty(shape, dtype=_DTYPES[int(code)], device=self.device)
                    dist.recv(h, self.ranks[owner], group=self.group)
            loss = token_loss(h, targets) if self.module.has_last else torch.zeros((), device=self.device)
        out = loss.detach().float().reshape(1).clone()
        dist.broadcast(out, self.ranks[(n - 1) % self.pp], group=self.group)
        return out[0]


_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
