"""Loading a Hugging Face model directory, shared by validate and evaluate."""

from __future__ import annotations

from pathlib import Path


class ModelLoadError(ValueError):
    """The directory is not a loadable safetensors Hugging Face model; the message says why."""


def load_hf_model(model_dir: Path):
    """Load with transformers from safetensors only (never a pickled .bin)."""
    from transformers import AutoModelForCausalLM

    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(f"{model_dir}: no config.json; not a Hugging Face model directory")
    if not list(model_dir.glob("*.safetensors")):
        raise ModelLoadError(f"{model_dir}: no .safetensors weights (pickled weights are refused)")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), use_safetensors=True)
    except Exception as e:  # transformers raises many types for a damaged model
        raise ModelLoadError(f"{model_dir}: does not load with transformers: {e}") from None
    return model.eval()
