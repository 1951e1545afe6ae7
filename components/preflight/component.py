"""KFP component `preflight` (never cached): benchmark the nodes, plan, and gate the run."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Markdown, Metrics, Output

from components import STAGE_IMAGE


@dsl.component(base_image=STAGE_IMAGE, install_kfp_package=False)
def preflight(
    dataset: Input[Dataset],
    data: dict,
    model: dict,
    train: dict,
    eval: dict,
    cluster: dict,
    preflight: dict,
    store: dict,
    metrics: Output[Metrics],
    report: Output[Markdown],
    verdict: Output[Artifact],
) -> None:
    """Fails the run when the inputs cannot train (components/prelaunch.py), too few nodes are
    healthy or the plan does not fit; else writes the verdict (healthy and excluded nodes) that
    train takes as its input."""
    import json
    from pathlib import Path

    from components import summaries
    from components.identity import trained_to_the_end
    from components.mixture import identity_of
    from components.preflight.stage import gate, run_preflight, summary
    from components.prelaunch import check_inputs
    from components.store import Ref
    from components.task import input_ref, stage_task

    # every group is checked here (eval's would otherwise first be in validate's, which is retried)
    with stage_task(
        "preflight", data=data, model=model, train=train, eval=eval, preflight=preflight, cluster=cluster, store=store
    ) as t:
        g, cfg = t.groups, t.groups["preflight"]
        ref = input_ref(dataset)
        # what would fail training (the data's fit, the vocabulary, the resume seed) fails here, in
        # the task KFP never retries, not in train's (retried: an evicted driver is not a bad config)
        manifest = t.store.manifest(Ref.parse(ref))
        check_inputs(manifest, g["model"], g["train"], g["cluster"], t.store, g["data"].cache_gb, data=g["data"])
        mixture = identity_of(g["data"], manifest)  # a mixture's weights: part of the identity
        if done := trained_to_the_end(ref, g["model"], g["train"], t.store, mixture):  # a resume with no step left
            why = f"{done} is at train.steps={g['train'].steps}: the resumed run trains no step"
            Path(report.path).write_text(f"# Preflight\n\nskipped: {why}\n")
            Path(verdict.path).write_text(json.dumps({"passed": True, "dataset": ref, "skipped": why}, indent=2))
            verdict.metadata.update({"passed": True, "skipped": why})
            summaries.attach(verdict, summaries.PreflightSummary([], "", 0.0, 0.0, skipped=why))
            return
        result = run_preflight(ref, g["model"], g["train"], g["cluster"], cfg, g["store"], t.store)
        for node in result.nodes:
            for key, value in node.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "rank":
                    metrics.log_metric(f"node{node['rank']}_{key}", float(value))
        for key, value in result.plan.as_dict().items():
            if value is not None:
                metrics.log_metric(f"plan_{key}", float(value))
        metrics.log_metric("healthy_nodes", float(len(result.healthy)))
        metrics.log_metric("preflight_seconds", result.seconds)
        Path(report.path).write_text(result.markdown)  # the UI's; the store has it as HTML too
        report.metadata.update({"report_html": str(result.report_path)})
        gate(result)  # raises (inside the task: its `failed` event): no verdict, so train cannot start
        passed = {"passed": True, "dataset": ref, "healthy": result.healthy}
        excluded = {"unhealthy": result.unhealthy, "excluded_hosts": result.excluded_hosts}  # train stays off these
        excluded.update(left_out=result.left_out, warnings=result.warnings, reused_min=result.reused_min)
        Path(verdict.path).write_text(json.dumps({**passed, **excluded}, indent=2))
        verdict.metadata.update({"passed": True, "excluded_nodes": sorted(result.unhealthy)})
        summaries.attach(verdict, summary(result, cfg, g["train"].precision))
