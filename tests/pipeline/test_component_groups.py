"""A group edited in the Kubeflow UI reaches each component as a plain dict (numbers as floats,
as a protobuf Struct carries them); the component's own `checked_groups` call refuses an invalid
one naming the key, before the stage runs. Called as the components' python functions: no
pipeline, no store, no stage work."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from components.config import ConfigError, compose, group_dicts
from components.evaluate.component import evaluate
from components.tokenize.component import tokenize_merge, tokenize_plan, tokenize_shard
from components.validate.component import validate
from tests.conftest import CORPUS


@pytest.fixture(scope="module")
def groups():
    return group_dicts(compose([f"data.paths=[{CORPUS}]"]))


def as_the_ui_sends(value):
    """Every number a float, as a protobuf Struct carries it."""
    if isinstance(value, dict):
        return {k: as_the_ui_sends(v) for k, v in value.items()}
    if isinstance(value, list):
        return [as_the_ui_sends(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


@pytest.fixture
def no_stage_work(monkeypatch):
    """The stages and the store must not be reached: an unchecked group would get that far."""

    def reached(*args, **kwargs):
        raise AssertionError("the stage ran with a group checked_groups should have refused")

    for target in (
        "components.store.open_store",
        "components.validate.stage.run_validate",
        "components.evaluate.stage.run_evaluate",
        "components.tokenize.plan.make_plan",
        "components.tokenize.plan.load_plan",
    ):
        monkeypatch.setattr(target, reached)


def artifact(tmp_path, name: str, ref: str | None = None) -> SimpleNamespace:
    path = tmp_path / name
    if ref is not None:
        path.write_text(json.dumps({"ref": ref}))
    return SimpleNamespace(path=str(path), metadata={})


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("loss_tolerance", 0, "eval.loss_tolerance: must be > 0, got 0"),
        ("val_blocks", "many", "eval.val_blocks"),
        ("launch", "gpu", "eval.launch: must be one of auto, pod, replicas, got 'gpu'"),
    ],
)
def test_validate_refuses_an_invalid_eval_group_naming_the_key(groups, tmp_path, no_stage_work, key, value, message):
    eval_group = as_the_ui_sends({**groups["eval"], key: value})
    with pytest.raises(ConfigError, match=message):
        validate.python_func(
            trained_model=artifact(tmp_path, "trained", "model/tiny@v1"),
            eval=eval_group,
            cluster=as_the_ui_sends(groups["cluster"]),
            store=as_the_ui_sends(groups["store"]),
            pod_memory_gb=16.0,
            verdict=artifact(tmp_path, "verdict"),
            validated_model=artifact(tmp_path, "validated"),
        )


def test_evaluate_refuses_an_invalid_eval_group_naming_the_key(groups, tmp_path, no_stage_work):
    with pytest.raises(ConfigError, match="eval.batch_size: must be >= 1, got 0"):
        evaluate.python_func(
            validated_model=artifact(tmp_path, "validated", "model/tiny@v1"),
            eval=as_the_ui_sends({**groups["eval"], "batch_size": 0}),
            cluster=as_the_ui_sends(groups["cluster"]),
            store=as_the_ui_sends(groups["store"]),
            pod_memory_gb=16.0,
            metrics=artifact(tmp_path, "metrics"),
            report=artifact(tmp_path, "report"),
        )


def test_tokenize_refuses_an_invalid_data_group_naming_the_key(groups, tmp_path, no_stage_work):
    """A cross-group rule too: blocks longer than the model's positions."""
    too_long = groups["model"]["max_seq_len"] + 1
    with pytest.raises(ConfigError, match=rf"data.seq_len: {too_long} exceeds model.max_seq_len="):
        tokenize_plan.python_func(
            data=as_the_ui_sends({**groups["data"], "seq_len": too_long}),
            tokenizer=as_the_ui_sends(groups["tokenizer"]),
            model=as_the_ui_sends(groups["model"]),
            store=as_the_ui_sends(groups["store"]),
            plan=artifact(tmp_path, "plan"),
        )


@pytest.mark.parametrize("task", ["shard", "merge"])
def test_the_shard_and_merge_tasks_check_the_data_group_too(groups, tmp_path, no_stage_work, task):
    bad = as_the_ui_sends({**groups["data"], "shards": 0})
    store = as_the_ui_sends(groups["store"])
    with pytest.raises(ConfigError, match="data.shards: must be >= 1, got 0"):
        if task == "shard":
            item = {"plan": "tokenizer/kjv@v", "index": 0.0, "data": bad}  # its source's group, from the plan
            tokenize_shard.python_func(shard=item, store=store)
        else:
            tokenize_merge.python_func(
                shards=[],
                plan=artifact(tmp_path, "plan", "tokenizer/kjv@v"),
                data=bad,
                tokenizer=as_the_ui_sends(groups["tokenizer"]),
                store=store,
                dataset=artifact(tmp_path, "dataset"),
            )
