"""gpu: what liftoff's train step does on one GPU. `python -m benchmarks.gpu` (< 8 minutes on
one H200), in an environment with a CUDA build of torch (the stage image).

JSON lines, one per measurement, then the summary line:
- `gemm`: preflight's bf16 and fp8 GEMMs (8192^3) in TFLOP/s against the device's dense peak;
- `train`: bf16, fp8 tensorwise and fp8 rowwise, each compiled per block, on the largest
  preset (>= 1B) whose plan fits one device with the lightest activation checkpointing that
  fits: tokens/s, MFU (against the bf16 peak, as torchtitan), planned vs measured peak memory
  (`torch.cuda.max_memory_allocated`); each case in its own process, so memory is its own.
- `parallel` (2 or more GPUs on the node): FSDP bf16, FSDP fp8 with fp8 all-gather and HSDP
  (4+ GPUs) on all of them, one torchrun launch each (`benchmarks/gpu_parallel.py`): tokens/s
  and MFU side by side;
- summary: `ratio` = fp8 (best recipe) / bf16 tokens/s. Targets on an H200: >= 1.25
  (torchao reports 1.2-1.28x on Llama3-8B), bf16 MFU >= 45%, memory plan error <= 5%.
Without a GPU it prints one line saying so. `--smoke` runs the same code on the CPU with the
tiny model (fp32 GEMMs only), to check the script itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import torch

from components.config import ActivationCheckpointing as AC
from components.config import Fp8Recipe, ModelConfig, Parallelism, Precision, TrainConfig, defaults

PRESETS = ("7b", "1b")  # largest first
CASES = (("bf16", "tensorwise"), ("fp8", "tensorwise"), ("fp8", "rowwise"))
SEQ_LEN, WARMUP, STEPS, GEMM_SIZE = 4096, 3, 10, 8192


def preset(name: str) -> ModelConfig:
    from omegaconf import OmegaConf

    from components.config import compose

    return OmegaConf.to_object(compose([f"model={name}"])).model


def train_config(precision: str, recipe_name: str, ac_every: int, micro: int) -> TrainConfig:
    return defaults(
        "train",
        precision=Precision(precision),
        fp8_recipe=Fp8Recipe(recipe_name),
        activation_checkpointing=AC.full if ac_every > 0 else AC.off,
        ac_every_n_blocks=max(ac_every, 1),
        micro_batch_size=micro,
        parallelism=Parallelism.ddp,
        compile=True,
        lr=3e-4,
        warmup_steps=1,
        steps=WARMUP + STEPS,
    )


def choose(device_gb: float, seq_len: int, presets: tuple[str, ...]) -> tuple[str, int, int, float]:
    """(preset, AC every n blocks (0 = off), micro batch, planned GB) that fits both precisions."""
    from components.preflight.plan import plan

    for name in presets:
        model = preset(name)
        for ac_every in (0, 4, 2, 1):
            for micro in (4, 2, 1):
                planned = [
                    plan(model, train_config(p, "tensorwise", ac_every, micro), 1, seq_len).total_gb for p, _ in CASES
                ]
                if max(planned) <= 0.9 * device_gb:
                    return name, ac_every, micro, max(planned)
    raise SystemExit(f"no preset of {presets} fits {device_gb:.0f} GB")


def gemm_rows(device: torch.device, size: int) -> list[dict]:
    from components.devices import peak_tflops
    from components.precision import RECIPES
    from components.preflight.bench import gemm_tflops

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows = []
    for precision in RECIPES.values():
        if precision.name == "fp32" or not precision.supported(device):
            continue
        tflops = gemm_tflops(precision, size, 20, device)
        peak = peak_tflops(name, precision.name)
        rows.append(
            {"kind": "gemm", "dtype": precision.name, "tflops": tflops, "peak_tflops": peak}
            | ({"fraction_of_peak": tflops / peak} if peak else {})
        )
    return rows


def run_case(model_name: str, precision: str, recipe_name: str, ac_every: int, micro: int, seq_len: int) -> dict:
    """One training configuration in this process: build as the worker does, time the steps."""
    import torch.nn.functional as F

    from components.devices import peak_tflops
    from components.model_math import flops_per_token, mfu
    from components.models import build_model, count_params
    from components.optimizer import build_optimizer
    from components.parallel.apply import apply_compile
    from components.parallel.checkpointing import apply_activation_checkpointing
    from components.precision import recipe
    from components.preflight.plan import plan
    from components.train.optim import clip_and_step

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model_cfg = preset(model_name)
    if model_cfg.vocab_size is None:  # the tiny preset takes its vocabulary from the dataset
        model_cfg.vocab_size = 1024
    train = train_config(precision, recipe_name, ac_every, micro)
    if device.type != "cuda":
        train.compile = False
    with torch.device(device):
        model = build_model(model_cfg, model_cfg.vocab_size, seed=0)
    flops = flops_per_token(model_cfg, count_params(model, exclude_embeddings=True), seq_len)
    r = recipe(train.precision)
    r.apply(model, train, device)
    if train.activation_checkpointing:
        apply_activation_checkpointing(model, "full", train.ac_every_n_blocks)
    if train.compile:
        apply_compile(model)
    optimizer = build_optimizer(model, train)
    batch = torch.randint(0, model_cfg.vocab_size, (micro, seq_len + 1), device=device)

    def step() -> None:
        with r.autocast(device, fsdp=False):
            logits = model(input_ids=batch[:, :-1]).logits
        F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten()).backward()
        clip_and_step(model, optimizer, 1.0, None)

    t0 = time.perf_counter()
    for _ in range(WARMUP):
        step()
    warmup_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / STEPS
    tokens_per_s = micro * seq_len / seconds
    peak = peak_tflops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    planned_gb = plan(model_cfg, train, 1, seq_len).total_gb
    row = {
        "kind": "train",
        "model": model_name,
        "precision": precision,
        "fp8_recipe": recipe_name if precision == "fp8" else None,
        "ac_every_n_blocks": ac_every,
        "micro_batch": micro,
        "seq_len": seq_len,
        "step_s": seconds,
        "warmup_and_compile_s": warmup_s,
        "tokens_per_s": tokens_per_s,
        "mfu": mfu(tokens_per_s, flops, peak, 1),
        "planned_gb": planned_gb,
    }
    if device.type == "cuda":
        measured_gb = torch.cuda.max_memory_allocated() / 1e9
        row |= {"measured_gb": measured_gb, "memory_plan_error": measured_gb / planned_gb - 1}
    return row


def run_parallel(model_name: str, ac_every: int, micro: int, seq_len: int) -> list[dict]:
    """The sharded cases on every GPU of this node, when it has 2 or more."""
    from benchmarks.gpu_parallel import cases, launch

    n = torch.cuda.device_count()
    rows = []
    for case in cases(n) if n >= 2 else []:  # one launch each: a case's peak memory is its own
        rows += launch(n, [case], [model_name, str(ac_every), str(micro), str(seq_len)])
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str]) -> int:
    if "--case" in argv:
        i = argv.index("--case")
        model_name, precision, recipe_name, ac_every, micro, seq_len = argv[i + 1 : i + 7]
        print(json.dumps(run_case(model_name, precision, recipe_name, int(ac_every), int(micro), int(seq_len))))
        return 0
    smoke = "--smoke" in argv
    if not torch.cuda.is_available() and not smoke:
        print(json.dumps({"name": "gpu", "skipped": "no CUDA device here; run `python -m benchmarks.gpu` on a GPU"}))
        return 0
    device = torch.device("cuda" if not smoke else "cpu")
    if smoke:
        model_name, ac_every, micro, planned, seq_len = "tiny", 1, 2, None, 64
    else:
        device_gb = torch.cuda.get_device_properties(device).total_memory / 1e9
        seq_len = SEQ_LEN
        model_name, ac_every, micro, planned = choose(device_gb, seq_len, PRESETS)
    print(json.dumps({"kind": "choice", "model": model_name, "ac_every_n_blocks": ac_every, "micro_batch": micro,
                      "planned_gb": planned}), flush=True)  # fmt: skip
    for row in gemm_rows(device, 256 if smoke else GEMM_SIZE):
        print(json.dumps(row), flush=True)
    rows, failed = [], []
    for precision, recipe_name in CASES:
        args = [model_name, precision, recipe_name, str(ac_every), str(micro), str(seq_len)]
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.gpu", "--case", *args], stdout=subprocess.PIPE, text=True
        )
        if proc.returncode:
            failed.append(f"{precision}/{recipe_name} exit {proc.returncode}")
            print(json.dumps({"kind": "train", "case": args, "failed": proc.returncode}), flush=True)
            continue
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    parallel = run_parallel(model_name, ac_every, micro, seq_len) if device.type == "cuda" else []
    failed += [f"{r['layout']}/{r['precision']} {r['failed']}" for r in parallel if "failed" in r]
    bf16 = next((r for r in rows if r["precision"] == "bf16"), None)
    fp8 = max((r for r in rows if r["precision"] == "fp8"), key=lambda r: r["tokens_per_s"], default=None)
    errors = [abs(r["memory_plan_error"]) for r in rows if "memory_plan_error" in r]
    summary = {
        "name": "gpu",
        "value": fp8["tokens_per_s"] if fp8 else None,
        "baseline": bf16["tokens_per_s"] if bf16 else None,
        "ratio": fp8["tokens_per_s"] / bf16["tokens_per_s"] if fp8 and bf16 else None,
        "unit": "tokens/s fp8 / bf16",
        "fp8_recipe": fp8["fp8_recipe"] if fp8 else None,
        "bf16_mfu": bf16["mfu"] if bf16 else None,
        "worst_memory_plan_error": max(errors) if errors else None,
        "failed": failed,
    }
    sharded = {f"{r['layout']}/{r['precision']}": r for r in parallel if "failed" not in r}
    if "fsdp/bf16" in sharded and "fsdp/fp8" in sharded:
        summary["fsdp_fp8_ratio"] = sharded["fsdp/fp8"]["tokens_per_s"] / sharded["fsdp/bf16"]["tokens_per_s"]
        summary["fsdp_mfu"] = {k: r["mfu"] for k, r in sharded.items()}
    print(json.dumps(summary))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
