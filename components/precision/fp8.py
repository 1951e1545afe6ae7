"""fp8 training with torchao: Float8Linear GEMMs on the eligible Linears, bf16 for the rest
(attention, norms, the output head), fp32 master weights and optimizer state.

As torchtitan: the output head stays high precision (its logits feed the loss directly);
under FSDP2 the bf16 MixedPrecisionPolicy applies and, with tensorwise scaling, weights are
all-gathered in fp8 (`enable_fsdp_float8_all_gather`) with their scales precomputed once
per optimizer step for all layers (`precompute_float8_dynamic_scale_for_fsdp`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from components.config import Fp8Recipe, ModelConfig, TrainConfig
from components.models import spec_of
from components.parallel import ParallelDims
from components.precision.base import PrecisionError, fp8_eligible_dims
from components.precision.bf16 import BF16

if TYPE_CHECKING:
    import torch


def module_filter(head: str):
    """torchao's `module_filter_fn(module, fqn)`: which Linears become Float8Linear (every
    eligible one but the model's output head, `head`)."""
    import torch

    def keep(module: torch.nn.Module, fqn: str) -> bool:
        linear = isinstance(module, torch.nn.Linear)
        return linear and fqn != head and fp8_eligible_dims(module.in_features, module.out_features)

    return keep


def head_of(model: torch.nn.Module) -> str | None:
    """The output head's name (never fp8) of a model of a family (components/models/); a plain
    module (a test's, a benchmark's) has none."""
    return spec_of(model).head if getattr(model, "config", None) is not None else None


def float8_modules(model: torch.nn.Module) -> list[str]:
    """Qualified names of the Float8Linear modules in the live model, as it trains (wrappers
    included in the names)."""
    from torchao.float8.float8_linear import Float8Linear

    return [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]


def float8_cast_configs(model: torch.nn.Module) -> list[str]:
    """The distinct cast configurations of the live Float8Linear modules, as torchao writes
    them (weight, grad output for grad weight, e.g. `w:dyn_axs_e4m3,go_gw:dis_ten_e4m3`)."""
    from torchao.float8.float8_linear import Float8Linear

    return sorted(
        {
            f"w:{m.config.cast_config_weight.short_str()},go_gw:{m.config.cast_config_grad_output_for_grad_weight.short_str()}"
            for m in model.modules()
            if isinstance(m, Float8Linear)
        }
    )


def _cast_input_to_bf16(module: torch.nn.Module, args: tuple):
    """torchao's Float8Linear follows CUDA autocast only; on a CPU under bf16 autocast its
    input would stay fp32. Cast it as CUDA autocast would, so CPU runs the GPU recipe."""
    import torch

    if torch.is_autocast_enabled("cpu"):
        return (args[0].to(torch.bfloat16), *args[1:])
    return None


class FP8(BF16):
    name = "fp8"

    def block_act_bytes(self, tp: int, sp: bool = False, fsdp: bool = False) -> tuple[float, float, float, float]:
        """Under TP torchao's Float8Colwise/RowwiseParallel cast each Float8Linear's input to
        fp8 before the module, so what the Linears save is fp8 (1 B): the five whole
        hidden-sized inputs, o_proj's and down_proj's split ones; SDPA's output is saved once
        more at bf16 (counted under a tp=2 fake process group, benchmarks/planner_accuracy.py).
        Under sequence parallel the residual stream and norms split as in bf16 and the gathered
        inputs are fp8 (2 B whole; counted under tp 2 and 4 fake process groups). Under FSDP
        (`fsdp`) counted under fake FSDP x tp 2 and 4 groups without sequence parallel."""
        if tp == 1:
            return super().block_act_bytes(tp, fsdp=fsdp)
        if sp:  # the whole part is the fp8 gathered inputs; under FSDP the split residual stream assumed to
            # save bf16's 10 B (fp8 runs sequence parallel on CUDA only: never counted on a CPU)
            whole, split = 2.0, (11.0 if fsdp else 21.0)
        else:  # the Linears' inputs are fp8 already: FSDP's bf16 residual stream saves 4 B of the whole
            whole, split = (17.0 if fsdp else 21.0), 5.0
        return whole, split, self.act_bytes_per_kv, self.act_bytes_per_ffn - 1.0

    def check_model(self, model: ModelConfig) -> None:
        if not fp8_eligible_dims(model.hidden_size, model.hidden_size):  # every block Linear has hidden_size
            head_dim = model.hidden_size // model.num_heads
            raise PrecisionError(
                "train.precision=fp8 but no Linear layer has both dims divisible by 16 "
                f"(hidden_size={model.hidden_size}, kv projection={model.num_kv_heads * head_dim}, "
                f"ffn_hidden_size={model.ffn_hidden_size})"
            )

    def check_device(self, device: torch.device) -> None:
        import torch

        if device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            if (major, minor) < (8, 9):
                raise PrecisionError(
                    "train.precision=fp8 needs a GPU with compute capability >= 8.9 (Ada, Hopper, Blackwell); "
                    f"{torch.cuda.get_device_name(device)} has {major}.{minor}. Use train.precision=bf16."
                )
            return
        try:  # CPU: torch's emulated scaled matmul
            a = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
            one = torch.tensor(1.0, device=device)
            torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        except (RuntimeError, NotImplementedError) as e:
            raise PrecisionError(f"train.precision=fp8: this torch build has no fp8 matmul on {device}: {e}") from None

    def float8_config(self, train: TrainConfig, device: torch.device):
        from torchao.float8 import Float8LinearConfig

        config = Float8LinearConfig.from_recipe_name(train.fp8_recipe.value)
        if self.fsdp_float8_all_gather(train):
            config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
        if device.type == "cpu":
            # oneDNN has no fp8 matmul kernel for most CPUs: torch._scaled_mm runs its reference
            # implementation ("ref:any", 0.25 s for a 512x64x192 GEMM, 95% of a tiny fp8 step).
            # On the CPU, torchao's emulation multiplies the same float8 operands (quantized and
            # scaled exactly as on a GPU) in fp32; a GPU runs the real fp8 GEMM.
            config = dataclasses.replace(config, emulate=True)
        return config

    def apply(self, model: torch.nn.Module, train: TrainConfig, device: torch.device) -> None:
        from torchao.float8 import convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear

        self.check_device(device)
        convert_to_float8_training(
            model, config=self.float8_config(train, device), module_filter_fn=module_filter(head_of(model))
        )
        converted = [m for m in model.modules() if isinstance(m, Float8Linear)]
        if not converted:
            raise PrecisionError("train.precision=fp8 but no Linear layer was eligible for Float8Linear")
        if device.type != "cuda":
            for m in converted:
                m.register_forward_pre_hook(_cast_input_to_bf16)

    def describe(self, model: torch.nn.Module, train: TrainConfig) -> dict:
        modules = float8_modules(model)
        said = f"fp8 ({train.fp8_recipe.value}) in {len(modules)} Float8Linear, bf16 elsewhere"
        return {"float8_linear_modules": modules, "float8_cast_configs": float8_cast_configs(model), "said": said}

    def fsdp_float8_all_gather(self, train: TrainConfig) -> bool:
        """FSDP all-gathers the Float8Linear weights in fp8: only dynamic tensorwise scales can
        be computed once for the whole weight before the all-gather, and only a process group
        of more than one rank is sharded at all (see `parallel.wrap`)."""
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_initialized() else 1
        sharded = ParallelDims.of(train, world).fsdp  # FSDP over 2+ data-parallel ranks
        return sharded and train.fp8_recipe == Fp8Recipe.tensorwise

    def after_optimizer_step(self, model: torch.nn.Module, train: TrainConfig, fsdp: bool) -> None:
        if fsdp and self.fsdp_float8_all_gather(train):
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(model)

    def copy_bytes(self, linear: bool, fp8_eligible: bool, fsdp: bool, train) -> float:
        if fp8_eligible:  # DDP: the fp8 casts are transient, never cached
            return (1.0 if train.fp8_recipe == Fp8Recipe.tensorwise else 2.0) if fsdp else 0.0
        return super().copy_bytes(linear, fp8_eligible, fsdp, train)

    def gemm(self, size: int, device: torch.device):
        """A GPU's fp8 GEMM (`torch._scaled_mm`); elsewhere what training runs in its place: the
        emulated Float8Linear's forward (both operands quantized to e4m3 with their dynamic
        tensorwise scales, then multiplied in fp32), 2-3x slower on a CPU than torch's reference
        fp8 kernel, which training there never calls."""
        import torch

        torch.manual_seed(0)
        if device.type != "cuda":
            from torchao.float8 import Float8LinearConfig
            from torchao.float8.float8_linear import Float8Linear

            config = dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"), emulate=True)
            linear = Float8Linear.from_float(torch.nn.Linear(size, size, bias=False, device=device), config=config)
            x = torch.randn(size, size, device=device, dtype=torch.bfloat16)

            def emulated():
                with torch.no_grad():
                    return linear(x)

            return emulated
        a = torch.randn(size, size, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(size, size, device=device).t().contiguous().t().to(torch.float8_e4m3fn)
        one = torch.tensor(1.0, device=device)
        return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
