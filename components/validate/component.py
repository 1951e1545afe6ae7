"""KFP component `validate`: a trained model in, a verdict out; an unsound model fails the run."""

from kfp import dsl
from kfp.dsl import Input, Metrics, Model, Output

from components import STAGE_IMAGE


@dsl.component(base_image=STAGE_IMAGE, install_kfp_package=False)
def validate(
    trained_model: Input[Model],
    eval: dict,
    cluster: dict,
    store: dict,
    pod_memory_gb: float,
    verdict: Output[Metrics],
    validated_model: Output[Model],
) -> None:
    """Passes the model on to evaluate as `validated_model` only when every check holds. In this
    pod while `pod_memory_gb` (its memory request) holds the model, else on the cluster's nodes."""
    import json
    from pathlib import Path

    from components import summaries
    from components.task import input_ref, stage_task
    from components.validate.stage import run_validate

    with stage_task("validate", eval=eval, cluster=cluster, store=store) as task:
        ref = input_ref(trained_model)
        g = task.groups
        result = run_validate(ref, g["eval"], task.store, g["cluster"], g["store"], pod_memory_gb)
        for name, ok in result.checks.items():
            verdict.log_metric(f"check_{name}", 1.0 if ok else 0.0)
        for name, value in result.numbers.items():
            verdict.log_metric(name, float(value))
        Path(validated_model.path).write_text(json.dumps({"ref": ref, "checks": result.checks}, indent=2))
        validated_model.metadata.update({"ref": ref})
        summaries.attach(validated_model, summaries.ValidateSummary(dict(result.checks)))
