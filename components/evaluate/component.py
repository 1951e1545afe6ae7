"""KFP component `evaluate`: a validated model in; metrics and an HTML report out."""

from kfp import dsl
from kfp.dsl import HTML, Input, Metrics, Model, Output

from components import STAGE_IMAGE


@dsl.component(base_image=STAGE_IMAGE, install_kfp_package=False)
def evaluate(
    validated_model: Input[Model],
    eval: dict,
    cluster: dict,
    store: dict,
    pod_memory_gb: float,
    metrics: Output[Metrics],
    report: Output[HTML],
) -> str:
    """Returns the evaluation's reference in the store. Measures in this pod while
    `pod_memory_gb` (its memory request) holds the model, else on the cluster's nodes."""
    from pathlib import Path

    from components import summaries
    from components.evaluate.stage import run_evaluate
    from components.task import input_ref, stage_task

    with stage_task("evaluate", eval=eval, cluster=cluster, store=store) as task:
        model_ref = input_ref(validated_model)
        g = task.groups
        result = run_evaluate(model_ref, g["eval"], task.store, g["cluster"], g["store"], pod_memory_gb)
        for name, value in result.metrics.items():
            metrics.log_metric(name, float(value))
        Path(report.path).write_text(result.html)  # the UI's copy; kfp.local names it `report`, no extension
        report.metadata.update({"ref": str(result.manifest.ref), "report_html": str(result.report_path)})
        m = result.metrics
        summaries.attach(report, summaries.EvaluateSummary(m["val_loss"], m["val_perplexity"]))
    return str(result.manifest.ref)
