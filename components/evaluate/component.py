"""KFP component `evaluate`: a validated model in; metrics and an HTML report out."""

from kfp import dsl
from kfp.dsl import HTML, Input, Metrics, Model, Output

from components import STAGE_IMAGE


@dsl.component(base_image=STAGE_IMAGE, install_kfp_package=False)
def evaluate(
    validated_model: Input[Model], eval: dict, store: dict, metrics: Output[Metrics], report: Output[HTML]
) -> str:
    """Returns the evaluation's reference in the store."""
    import json
    import logging
    import time
    from pathlib import Path

    from components.config import checked_groups
    from components.evaluate.stage import run_evaluate
    from components.store import open_store

    started = time.perf_counter()  # the stage's own work, after its imports (those are overhead)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from components.local_pod import enter_task_directory

    enter_task_directory("evaluate")  # under `liftoff run`: a directory of its own, as its pod would have
    groups = checked_groups(eval=eval, store=store)  # a UI-edited group is checked like the CLI's
    model_ref = json.loads(Path(validated_model.path).read_text())["ref"]
    result = run_evaluate(model_ref, groups["eval"], open_store(groups["store"]))
    print(f"liftoff-stage evaluate compute_s={time.perf_counter() - started:.3f}", flush=True)
    for name, value in result.metrics.items():
        metrics.log_metric(name, float(value))
    Path(report.path).write_text(result.html)  # the UI's copy; kfp.local names it `report`, no extension
    report.metadata.update({"ref": str(result.manifest.ref), "report_html": str(result.report_path)})
    return str(result.manifest.ref)
