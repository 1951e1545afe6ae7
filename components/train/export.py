"""Final export: Hugging Face format (safetensors + config + tokenizer)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from components.config import ModelConfig
from components.models import spec_for


def export_hf(
    model: torch.nn.Module, cfg: ModelConfig, vocab_size: int, tokenizer_dir: Path, out: Path, rank: int
) -> None:
    """Gather the full weights (a collective: every rank calls it) and save them on rank 0
    as its family's plain Hugging Face model (Llama: `LlamaForCausalLM`), which
    `AutoModelForCausalLM.from_pretrained` loads."""

    if getattr(model, "pp_mesh", None) is not None:
        full = gather_stages(model, rank)
    else:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return
    with torch.device("meta"):
        plain = spec_for(cfg).build(cfg, vocab_size)
    plain.load_state_dict({k: v.to(torch.float32) for k, v in full.items()}, strict=True, assign=True)
    if out.exists():
        shutil.rmtree(out)
    plain.save_pretrained(str(out), safe_serialization=True)
    shutil.copytree(tokenizer_dir, out, dirs_exist_ok=True)


def gather_stages(model: torch.nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """Under pipeline parallelism: each rank's stages whole (gathered over its data-parallel
    group), then data-parallel rank 0's pipeline sends them to rank 0, which joins them."""
    import torch.distributed as dist

    own = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    own = {k: v.detach().cpu() for k, v in own.items()}
    group = model.pp_mesh.get_group()
    if 0 not in dist.get_process_group_ranks(group):  # another data-parallel rank's pipeline
        return {}
    parts = [None] * model.pp_mesh.size() if rank == 0 else None
    dist.gather_object(own, parts, dst=0, group=group)
    return {k: v for part in parts or [] for k, v in part.items()}
