"""What `liftoff run` says about its stages: a status line as each starts and ends (from the
composed config and the task's KFP outputs), preflight's verdict table, and the end of a run:
lineage, metrics and where the reports are."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path

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
        parts += ["activation checkpointing"] if t.activation_checkpointing else []
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


def _meta(outputs: dict, name: str) -> dict:
    return dict(getattr(outputs.get(name), "metadata", None) or {})


def stage_result(end: StageEnd, cfg) -> str:
    """What a stage that succeeded produced, from its KFP outputs."""
    out = end.outputs
    if end.name == "tokenize":
        d = _meta(out, "dataset")
        reused = ", found in the store" if d.get("reused") else ""
        blocks = f"{d.get('train_blocks', 0):,.0f} train / {d.get('val_blocks', 0):,.0f} val blocks"
        return f"{d.get('ref')}: {blocks}{reused}"
    if end.name == "preflight":
        m = _meta(out, "metrics")
        nodes = len({k.split("_", 1)[0] for k in m if re.match(r"node\d+_", k)})
        device = cfg.preflight.device_memory_gb or min(v for k, v in m.items() if k.endswith("_device_memory_gb"))
        budget = device * cfg.preflight.memory_safety
        plan = f"plan {m.get('plan_total_gb', 0):.3g} GB per device of a {budget:.3g} GB budget"
        return f"{m.get('healthy_nodes', 0):.0f}/{nodes} nodes healthy, {plan}"
    if end.name == "train":
        m = _meta(out, "metrics")
        return (
            f"{_meta(out, 'trained_model').get('continued', 'fresh')}; "
            f"loss {m.get('initial_loss', float('nan')):.2f} -> {m.get('final_loss', float('nan')):.2f}, "
            f"{m.get('tokens_per_s', 0):,.0f} tokens/s, peak {m.get('peak_memory_gb', 0):.2f} GB, {out.get('Output')}"
        )
    if end.name == "validate":
        checks = {k: v for k, v in _meta(out, "verdict").items() if k.startswith("check_")}
        return f"{sum(v == 1.0 for v in checks.values())}/{len(checks)} checks passed"
    if end.name == "evaluate":
        m = _meta(out, "metrics")
        return f"val loss {m.get('val_loss', float('nan')):.4f}, perplexity {m.get('val_perplexity', float('nan')):.2f}"
    return ""


def verdict_table(outputs: dict, precision: str) -> list[str]:
    """Preflight's verdict, one row per node: its health and the benchmarks it was judged by
    (GEMM in the training precision), then why each unhealthy node is."""
    import json

    m = _meta(outputs, "metrics")
    verdict_file = getattr(outputs.get("verdict"), "path", None)
    verdict = json.loads(Path(verdict_file).read_text()) if verdict_file and Path(verdict_file).is_file() else {}
    names = {int(n.rsplit("#", 1)[1]): n for n in [*verdict.get("healthy", []), *verdict.get("unhealthy", {})]}
    ranks = sorted({int(k[4:].split("_", 1)[0]) for k in m if re.match(r"node\d+_", k)})
    gemm = f"gemm_tflops_{precision}" if any(k.endswith(f"_gemm_tflops_{precision}") for k in m) else "gemm_tflops_"
    columns = [(gemm, f"{gemm[12:] or 'gemm'} TFLOP/s"), ("membw_gbps", "mem GB/s")]
    columns += [("allreduce_busbw_gbps_", "busbw GB/s")]
    columns += [("device_memory_gb", "memory GB")]
    rows = [["node", "verdict", *(label for _, label in columns)]]
    for r in ranks:
        mine = {k.split("_", 1)[1]: v for k, v in m.items() if k.startswith(f"node{r}_")}
        cells = []
        for prefix, _ in columns:  # the first gemm dtype, the largest all-reduce message
            keys = sorted((k for k in mine if k.startswith(prefix)), key=lambda k: _size_of(k))
            cells.append(f"{mine[keys[-1] if prefix.startswith('allreduce') else keys[0]]:.4g}" if keys else "-")
        health = "UNHEALTHY" if names.get(r) in verdict.get("unhealthy", {}) else "healthy"
        rows.append([names.get(r, f"rank {r}"), health, *cells])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    table = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return table + [f"{node}: {'; '.join(why)}" for node, why in verdict.get("unhealthy", {}).items()]


def _size_of(key: str) -> float:
    m = re.search(r"_([\d.]+)mb$", key)
    return float(m.group(1)) if m else 0.0


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
            detail = stage_result(end, self.cfg)
            table = verdict_table(end.outputs, _value(self.cfg.train.precision)) if end.name == "preflight" else []
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
    preflight_html = _meta(ends["preflight"].outputs, "report").get("report_html") if "preflight" in ends else None
    if preflight_html and Path(preflight_html).is_file():  # the copy preflight published to the store
        kept["preflight.html"] = Path(shutil.copyfile(preflight_html, folder / "preflight.html"))
    model_ref = _meta(ends["train"].outputs, "trained_model").get("ref") if "train" in ends else None
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
        lines.append(f"train: {stage_result(train, result['cfg'])}")
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
