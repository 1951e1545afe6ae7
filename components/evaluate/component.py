"""KFP component `evaluate`: a validated model in; metrics and an HTML report out."""

from kfp import dsl
from kfp.dsl import HTML, Input, Metrics, Model, Output

from components import STAGE_IMAGE


@dsl.component(base_image=STAGE_IMAGE, install_kfp_package=False)
def evaluate(
    validated_model: Input[Model], eval: dict, store: dict, metrics: Output[Metrics], report: Output[HTML]
) -> str:
    """Returns the evaluation's reference in the store."""
    from pathlib import Path

    from components import summaries
    from components.evaluate.stage import run_evaluate
    from components.task import input_ref, stage_task

    with stage_task("evaluate", eval=eval, store=store) as task:
        model_ref = input_ref(validated_model)
        result = run_evaluate(model_ref, task.groups["eval"], task.store)
        for name, value in result.metrics.items():
            metrics.log_metric(name, float(value))
        Path(report.path).write_text(result.html)  # the UI's copy; kfp.local names it `report`, no extension
        report.metadata.update({"ref": str(result.manifest.ref), "report_html": str(result.report_path)})
        m = result.metrics
        summaries.attach(report, summaries.EvaluateSummary(m["val_loss"], m["val_perplexity"]))
    return str(result.manifest.ref)
