"""What `liftoff run` says about its stages: a status line as each starts and ends (from the
composed config and the task's KFP outputs), preflight's verdict table, and the end of a run:
lineage, metrics and where the reports are."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from components import summaries
from components.train.prometheus import node_port
from pipelines.progress import StageEnd, display_path

STAGES = ("tokenize", "preflight", "train", "validate", "evaluate")


def _value(x):
    return getattr(x, "value", x)


def metrics_where(port: int, nodes: int, local: bool) -> str:
    """Where the train stage's nodes serve their metrics (components/train/prometheus.py)."""
    if not local:
        return f"port {port} of each replica pod (deploy/monitoring/)"
    urls = [f"http://127.0.0.1:{node_port(port, i, True)}/metrics" for i in range(nodes)]
    return " ".join(urls)


def stage_plan(name: str, cfg) -> str:
    """What a stage is about to do, from the composed config."""
    c, t = cfg.cluster, cfg.train
    if name == "tokenize":
        source = cfg.data.hub_name or ", ".join(Path(p).name for p in cfg.data.paths)
        tokenizer = cfg.tokenizer.pretrained or f"byte-level BPE ({cfg.tokenizer.vocab_size})"
        return f"{source}, {tokenizer}, seq_len {cfg.data.seq_len}"
    if name == "preflight":
        return f"{c.nodes} node(s) x {c.procs_per_node} process(es) on {_value(c.scheduler)}: benchmarks and the plan"
    if name == "train":
        parts = [f"{c.nodes} node{'s' if c.nodes > 1 else ''}", _value(t.precision)]
        parts += (
            [f"{_value(t.activation_checkpointing)} activation checkpointing"] if t.activation_checkpointing else []
        )
        parts += [_value(t.parallelism), f"{t.steps} steps"]
        if t.metrics_port:
            local = _value(c.scheduler) == "local_cwd"
            parts.append(f"Prometheus metrics on {metrics_where(t.metrics_port, c.nodes, local)}")
        return ", ".join(parts)
    if name == "validate":
        return "file hashes, loading, a finite forward pass, loss against training's"
    if name == "evaluate":
        tasks = f", lm-eval {', '.join(cfg.eval.lm_eval_tasks)}" if cfg.eval.lm_eval_tasks else ""
        return f"{cfg.eval.val_blocks or 'all'} val blocks, {len(cfg.eval.prompts)} prompts{tasks}"
    return ""


def stage_result(end: StageEnd) -> str:
    """What a stage that succeeded produced: the typed summary it put in its outputs."""
    found = summaries.find(end.outputs)
    return found.line() if found is not None else "(no summary)"


def verdict_table(end: StageEnd) -> list[str]:
    """Preflight's verdict, one row per node, then why each unhealthy node is."""
    found = summaries.find(end.outputs)
    return found.table() if isinstance(found, summaries.PreflightSummary) else []


class StageLines:
    """The status lines: `[3/5] train ... 2 nodes, fp8, 60 steps` as a stage starts, then
    `ok 9.8 s, loss 6.95 -> 5.49, ...` (or `cached`, or `failed`) as it ends."""

    def __init__(self, cfg, say: Callable[[str], None]):
        self.cfg, self.say = cfg, say
        self.ends: dict[str, StageEnd] = {}
        self.failed: StageEnd | None = None
        self.current: str | None = None  # the stage running now

    def start(self, name: str) -> None:
        if name.startswith("tokenize-"):  # the fan-out: one status line for plan, shards and merge
            if name != "tokenize-plan":
                return
            name = "tokenize"
        self.current = name
        number = f"{STAGES.index(name) + 1}/{len(STAGES)}" if name in STAGES else "?"
        self.say(f"[{number}] {name} ... {stage_plan(name, self.cfg)}")

    def end(self, end: StageEnd, lines: list[str]) -> None:
        if end.name.startswith("tokenize-"):
            if end.ok and end.name != "tokenize-merge":
                if end.name.startswith("tokenize-shard"):
                    self.say(
                        f"      {'cached' if end.cached else 'ok'} {end.seconds:.1f} s, {end.outputs.get('Output')}"
                    )
                return
            end = dataclasses.replace(end, name="tokenize")
        self.ends[end.name] = end
        if not end.ok:
            self.failed = end
            self.say(f"      failed after {end.seconds:.1f} s")
            return
        try:
            detail, table = stage_result(end), verdict_table(end)
        except (KeyError, ValueError, TypeError, OSError) as e:  # a status line never fails a run
            detail, table = f"(no summary: {e})", []
        self.say(f"      {'cached' if end.cached else 'ok'} {end.seconds:.1f} s, {detail}")
        for row in table:
            self.say("        " + row)


def keep_outputs(folder: Path, ends: dict[str, StageEnd], store) -> dict[str, Path]:
    """Copies into the run folder what a reader opens after the run: the HTML reports under
    names ending in .html (kfp.local names the artifacts `report`, `curves`), preflight's report,
    and the run's TensorBoard events, from the model in the store (where they travel: no
    node's disk is read, and a cached train stage still has them)."""
    import shutil

    from components.store import Ref

    wanted = {
        "eval_report.html": ("evaluate", "report"),
        "train_curves.html": ("train", "curves"),
        "preflight.md": ("preflight", "report"),
    }
    kept = {}
    for name, (stage, output) in wanted.items():
        src = getattr(ends.get(stage, StageEnd(stage, False, 0, False)).outputs.get(output), "path", None)
        if src and Path(src).is_file():
            kept[name] = Path(shutil.copyfile(src, folder / name))
    said = {name: summaries.find(end.outputs) for name, end in ends.items()}
    preflight_html = getattr(said.get("preflight"), "report_html", None)
    if preflight_html and Path(preflight_html).is_file():  # the copy preflight published to the store
        kept["preflight.html"] = Path(shutil.copyfile(preflight_html, folder / "preflight.html"))
    model_ref = getattr(said.get("train"), "model", None)
    if model_ref:
        events = store.fetch(store.manifest(Ref.parse(model_ref))) / "tensorboard"
        if any(events.glob("events.*")):
            kept["tensorboard"] = Path(shutil.copytree(events, folder / "tensorboard", dirs_exist_ok=True))
    return kept


def lineage_lines(node: dict) -> list[str]:
    """Each artifact of the lineage once, with the ones it was made from."""
    lines, seen = [], set()

    def walk(n: dict) -> None:
        if n["ref"] in seen:
            return
        seen.add(n["ref"])
        shards = [p for p in n["parents"] if p["ref"].startswith("shard/")]
        others = [p for p in n["parents"] if not p["ref"].startswith("shard/")]
        named = [p["ref"] for p in others] + ([f"{len(shards)} shard(s) {shards[0]['ref']}, ..."] if shards else [])
        lines.append(f"  {n['ref']}" + (f"  <- {', '.join(named)}" if named else ""))
        for p in others + shards[:1]:  # a dataset of a thousand shards: their lineage is alike
            walk(p)

    walk(node)
    return lines


def summary_lines(result: dict) -> list[str]:
    """The end of a run: artifacts with lineage, metrics, where the reports, TensorBoard events,
    config and log are; the last line is the eval report."""
    lines = ["", "artifacts (each <- what it was made from):", *lineage_lines(result["lineage"]), "metrics:"]
    lines += [f"  {name}: {value:.6g}" for name, value in result["metrics"].items()]
    train = result["stages"].get("train")
    if train is not None and train.ok:
        lines.append(f"train: {stage_result(train)}")
    files, folder = result["files"], result["folder"]
    for name in ("train_curves.html", "preflight.html" if "preflight.html" in files else "preflight.md"):
        if name in files:
            lines.append(f"{name.split('.')[0].replace('_', ' ')}: {display_path(files[name])}")
    if "tensorboard" in files:
        compare = f"tensorboard --logdir {display_path(folder.parent)} compares runs"
        lines.append(f"tensorboard: {display_path(files['tensorboard'])}  ({compare})")
    saved = f".hydra/config.yaml, {result['log'].name}; {result['seconds']:.0f} s"
    lines.append(f"run folder: {display_path(folder)}  ({saved})")
    if "eval_report.html" in files:
        lines.append(f"report: {display_path(files['eval_report.html'])}")
    return lines
