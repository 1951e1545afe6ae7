"""KFP component `preflight` (never cached): benchmark the nodes, plan, and gate the run."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Markdown, Metrics, Output

from components import STAGE_IMAGE


@dsl.component(base_image=STAGE_IMAGE, install_kfp_package=False)
def preflight(
    dataset: Input[Dataset],
    model: dict,
    train: dict,
    cluster: dict,
    preflight: dict,
    store: dict,
    metrics: Output[Metrics],
    report: Output[Markdown],
    verdict: Output[Artifact],
) -> None:
    """Fails the run when too few nodes are healthy or the plan does not fit; else writes the
    verdict (healthy and excluded nodes) that train takes as its input."""
    import json
    import logging
    import time
    from pathlib import Path

    from components.config import checked_groups
    from components.preflight.stage import gate, report_markdown, run_preflight
    from components.store import open_store

    started = time.perf_counter()  # the stage's own work, after its imports (those are overhead)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from components.local_pod import enter_task_directory

    enter_task_directory("preflight")  # under `liftoff run`: a directory of its own, as its pod would have
    g = checked_groups(model=model, train=train, preflight=preflight, cluster=cluster, store=store)  # as the CLI
    cfg, store_cfg = g["preflight"], g["store"]
    result = run_preflight(
        json.loads(Path(dataset.path).read_text())["ref"],
        g["model"],
        g["train"],
        g["cluster"],
        cfg,
        store_cfg,
        open_store(store_cfg),
    )
    print(f"liftoff-stage preflight compute_s={time.perf_counter() - started:.3f}", flush=True)
    for node in result.nodes:
        for key, value in node.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "rank":
                metrics.log_metric(f"node{node['rank']}_{key}", float(value))
    for key, value in result.plan.as_dict().items():
        if value is not None:
            metrics.log_metric(f"plan_{key}", float(value))
    metrics.log_metric("healthy_nodes", float(len(result.healthy)))
    metrics.log_metric("preflight_seconds", result.seconds)
    Path(report.path).write_text(report_markdown(result, cfg))  # the UI's; the store has it as HTML too
    report.metadata.update({"report_html": str(result.report_path)})
    gate(result, cfg)  # raises: no verdict, so train cannot start
    passed = {"passed": True, "dataset": dataset.metadata.get("ref"), "healthy": result.healthy}
    excluded = {"unhealthy": result.unhealthy, "excluded_hosts": result.excluded_hosts}  # train stays off these
    Path(verdict.path).write_text(json.dumps({**passed, **excluded}, indent=2))
    verdict.metadata.update({"passed": True, "excluded_nodes": sorted(result.unhealthy)})
