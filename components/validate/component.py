"""KFP component `validate`: a trained model in, a verdict out; an unsound model fails the run."""

from kfp import dsl
from kfp.dsl import Input, Metrics, Model, Output

from components import STAGE_IMAGE


@dsl.component(base_image=STAGE_IMAGE, install_kfp_package=False)
def validate(
    trained_model: Input[Model], eval: dict, store: dict, verdict: Output[Metrics], validated_model: Output[Model]
) -> None:
    """Passes the model on to evaluate as `validated_model` only when every check holds."""
    import json
    import logging
    import time
    from pathlib import Path

    from components.config import checked_groups
    from components.store import open_store
    from components.validate.stage import run_validate

    started = time.perf_counter()  # the stage's own work, after its imports (those are overhead)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from components.local_pod import enter_task_directory

    enter_task_directory("validate")  # under `liftoff run`: a directory of its own, as its pod would have
    ref = json.loads(Path(trained_model.path).read_text())["ref"]
    groups = checked_groups(eval=eval, store=store)  # a UI-edited group is checked like the CLI's
    result = run_validate(ref, groups["eval"], open_store(groups["store"]))
    print(f"liftoff-stage validate compute_s={time.perf_counter() - started:.3f}", flush=True)
    for name, ok in result.checks.items():
        verdict.log_metric(f"check_{name}", 1.0 if ok else 0.0)
    for name, value in result.numbers.items():
        verdict.log_metric(name, float(value))
    Path(validated_model.path).write_text(json.dumps({"ref": ref, "checks": result.checks}, indent=2))
    validated_model.metadata.update({"ref": ref})
