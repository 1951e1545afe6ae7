"""KFP component `train`: a dataset version and config groups in; model, metrics and curves out."""

from kfp import dsl
from kfp.dsl import HTML, Artifact, Dataset, Input, Metrics, Model, Output

from components import STAGE_IMAGE


@dsl.component(base_image=STAGE_IMAGE, install_kfp_package=False)
def train(
    dataset: Input[Dataset],
    preflight_verdict: Input[Artifact],
    data: dict,
    model: dict,
    train: dict,
    cluster: dict,
    store: dict,
    trained_model: Output[Model],
    metrics: Output[Metrics],
    curves: Output[HTML],
) -> str:
    """Launch training with TorchX; returns the model reference `model/NAME@IDENTITY`."""
    import json
    from pathlib import Path

    from components import summaries
    from components.task import input_ref, stage_task
    from components.train.report import curves_html, final_metrics
    from components.train.stage import require_passing_verdict, run_train

    with stage_task("train", data=data, model=model, train=train, cluster=cluster, store=store) as task:
        verdict = require_passing_verdict(json.loads(Path(preflight_verdict.path).read_text()))
        g = task.groups
        result = run_train(
            input_ref(dataset),
            g["model"],
            g["train"],
            g["cluster"],
            g["store"],
            task.store,
            exclude_nodes=verdict.get("excluded_hosts", []),
            cache_gb=g["data"].cache_gb,
            data=g["data"],
            trains_no_step=bool(verdict.get("skipped")),  # preflight measured nothing: no step may train
        )
        ref = str(result.model.ref)
        Path(trained_model.path).write_text(json.dumps({"ref": ref, **result.result.to_json()}, indent=2))
        trained_model.metadata.update(
            {
                "ref": ref,
                "identity": result.identity,
                "checkpoint": result.checkpoint_version,
                "continued": result.result.continued,
            }
        )
        trained_model.metadata["preflight_excluded_nodes"] = sorted(verdict.get("unhealthy", {}))
        final = final_metrics(result.metrics)
        for name, value in final.items():
            metrics.log_metric(name, value)
        figures = [final.get(k) for k in ("initial_loss", "final_loss", "tokens_per_s", "peak_memory_gb")]
        nodes = list(dict.fromkeys(result.result.nodes))  # each node once, in rank order
        left_out = verdict.get("left_out", {})  # preflight's; a node quarantined since is off too
        left_out.update({n: "hung in a collective: quarantined, relaunched without it" for n in result.hung})
        summary = summaries.TrainSummary(ref, result.result.continued, *figures, nodes=nodes, left_out=left_out)
        summaries.attach(trained_model, summary)
        run = {
            "training run": result.identity,
            "model": ref,
            "started": result.result.continued,
            "precision": result.result.precision,
            "world": f"{result.result.world} ranks",
            "steps": str(result.result.steps),
        }
        Path(curves.path).write_text(curves_html(result.metrics, run))
    return ref
