"""The second model family, a Mixtral-style mixture of experts (issue 39, point 6): it trains
under FSDP and DDP, exports a plain `MixtralForCausalLM` that `transformers` loads and
generates with, validates and evaluates; its router's load-balancing loss is in the gradient."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from components.config import defaults
from components.evaluate.stage import run_evaluate
from components.plots import read_records
from components.validate.stage import run_validate
from tests.conftest import Trainer
from tests.helpers import TWO_NODES, assert_trains_like, final_weights

MOE = ["model=moe-tiny", "train.steps=6", "train.warmup_steps=2", "train.checkpoint_interval=6",
       "train.micro_batch_size=4", *TWO_NODES]  # fmt: skip


@pytest.fixture(scope="module")
def moe_runs(dataset_store, tmp_path_factory):
    """FSDP over two nodes; the same with the router's aux loss off; DDP over two nodes; and
    the first run's store."""
    trainers = [Trainer(dataset_store, tmp_path_factory.mktemp(name)) for name in ("fsdp", "no-aux", "ddp")]
    fsdp = trainers[0].run(*MOE, "train.parallelism=fsdp")
    no_aux = trainers[1].run(*MOE, "train.parallelism=fsdp", "model.router_aux_loss_coef=0")
    return fsdp, no_aux, trainers[2].run(*MOE), trainers[0].store


def test_a_mixture_of_experts_trains_under_fsdp_and_ddp_and_exports_a_plain_mixtral(moe_runs):
    """The FSDP run shards every block (its experts with it); DDP trains its losses and weights
    within 1e-4. The export loads in plain `transformers` as `MixtralForCausalLM` with the
    trained weights and generates; every step recorded each expert's share of the routed
    tokens (shares of 1)."""
    from transformers import AutoModelForCausalLM, MixtralForCausalLM

    fsdp, _, ddp, _ = moe_runs
    blocks = 2  # conf/model/moe-tiny.yaml
    assert fsdp.result.wrapped_modules["fsdp"] == blocks + 1 and ddp.result.wrapped_modules["ddp"] == 1
    assert_trains_like(fsdp, [ddp], steps=6)
    steps = read_records(fsdp.metrics)[0]
    assert all(len(s["expert_load"]) == 4 and math.isclose(sum(s["expert_load"]), 1.0) for s in steps)
    model = AutoModelForCausalLM.from_pretrained(str(fsdp.export))
    assert type(model) is MixtralForCausalLM and model.config.num_local_experts == 4
    # saved in Mixtral's published layout (each expert's w1, w2, w3), as plain tools read it
    experts = {k for k in final_weights(fsdp) if ".block_sparse_moe.experts." in k}
    (start,) = [e for e in read_records(fsdp.metrics)[1] if e.get("kind") == "start"]  # what training held
    assert len(experts) == 2 * 4 * 3 and sum(p.numel() for p in model.parameters()) == start["params"]
    # MFU counts the routed experts only: 2 of 4 a token, fewer FLOPs than 6 x the non-embedding params
    embedding = model.get_input_embeddings().weight.numel()
    assert start["flops_per_token"] < 6 * (start["params"] - embedding) * 0.8
    ids = torch.tensor([[3, 17, 42, 7]])
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 8) and torch.equal(out[:, :4], ids)


def test_a_mixture_of_experts_validates_and_evaluates_with_its_expert_load_plotted(moe_runs):
    fsdp, store = moe_runs[0], moe_runs[3]
    ref = str(fsdp.model.ref)
    verdict = run_validate(ref, defaults("eval"), store)
    assert verdict.numbers["loss_gap"] < 1e-5  # the token loss training measured, the aux loss apart
    result = run_evaluate(ref, defaults("eval", val_blocks=8, prompts=["In the beginning"], max_new_tokens=4), store)
    assert math.isfinite(result.metrics["val_loss"]) and result.samples[0]["continuation"]
    assert "alt='expert_load'" in result.html
    from components.train.report import curves_html

    # the run's own curves page (the train component's Kubeflow output): six curves and the experts'
    assert curves_html(fsdp.metrics).count("data:image/png;base64,") == 7


def test_the_router_aux_loss_is_in_the_gradient_and_a_model_trained_without_it_routes_differently(moe_runs):
    """One forward through the trainer's own loss (`forward_loss`) of a fresh moe-tiny: the
    router's gradient is the token loss's plus the coefficient times Mixtral's load-balancing
    loss (`transformers`' own function, computed again here); and the run trained with the
    coefficient at 0 routed its tokens otherwise than the run with it, on the same data."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from components.models import build_model, token_loss
    from components.precision import recipe
    from components.train.job import forward_loss

    def router_grad(coef: float, independent: bool) -> torch.Tensor:
        cfg = defaults(
            "model",
            family="moe",
            num_experts=4,
            experts_per_token=2,
            router_aux_loss_coef=coef,
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=4,
            ffn_hidden_size=96,
            vocab_size=128,
        )
        model = build_model(cfg, 128, seed=0)
        batch = torch.randint(0, 128, (4, 17), generator=torch.Generator().manual_seed(0))
        if independent:
            out = model(input_ids=batch[:, :-1])
            aux = load_balancing_loss_func(out.router_logits, 4, 2)
            (token_loss(out.logits, batch[:, 1:]) + coef * aux).backward()
        else:
            job = SimpleNamespace(
                pipeline=None, recipe=recipe("fp32"), device=torch.device("cpu"), fsdp=False, model=model,
                train=SimpleNamespace(loss_chunk_tokens=0),
            )  # fmt: skip
            loads: list = []
            forward_loss(job, batch, loads).backward()
            assert loads[0].sum() == 2 * 2 * 4 * 16  # blocks x experts a token x tokens
        return model.model.layers[0].mlp.gate.weight.grad

    with_aux, without = router_grad(0.5, False), router_grad(0.0, False)
    assert not torch.allclose(with_aux, without)
    assert torch.allclose(with_aux, router_grad(0.5, True), atol=1e-7)
    fsdp, no_aux, _, _ = moe_runs
    routed = [[s["expert_load"] for s in read_records(run.metrics)[0]] for run in (fsdp, no_aux)]
    assert routed[0][0] == pytest.approx(routed[1][0])  # the first step: the same model, the same data
    assert max(abs(a - b) for a, b in zip(routed[0][-1], routed[1][-1], strict=True)) > 1e-3
