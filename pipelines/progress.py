"""What `liftoff run` shows while it runs: a status line as each stage starts and ends, the
train stage's step lines and preflight's verdict. Everything else the run prints (kfp.local's
task logs, every replica's lines, C++ and library output of the processes it starts) goes to
the run's log file, and with `-v` to the terminal as well."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from components.train.prometheus import node_port

STAGES = ("tokenize", "preflight", "train", "validate", "evaluate")
_SYNC = b"\x00liftoff-sync\n"  # written through the captured stream: everything before it has been read
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# lines a stage's own processes print that the quiet output keeps: what trains, its steps,
# a relaunch after a failure
_SHOWN = re.compile(
    r"rank0 INFO [\w.]+: ((?:training on |step \d+/\d+ ).*)$|WARNING\]?:? ?(?:[\w.]+: )?(\S+ failed \(attempt .*)$"
)


def plain(text: str) -> str:
    return _ANSI.sub("", text)


class Console:
    """Captures the process-level stdout and stderr (fd 1 and 2, so what subprocesses and C++
    code write is captured too) into `log_path` for the duration of a `with` block; `say` writes
    to the terminal the block started with. `verbose` copies every captured line there too."""

    def __init__(self, log_path: Path, verbose: bool = False):
        self.log_path, self.verbose = log_path, verbose
        self._lock = threading.Lock()
        self._lines: list[str] = []
        self._synced = threading.Event()
        self._terminal: int | None = None
        self._reader_gone = False
        self.last_step: int | None = None  # the newest training step line shown

    def say(self, text: str = "") -> None:
        data = (text + "\n").encode()
        with self._lock:
            if self._reader_gone:
                return
            try:
                if self._terminal is None:
                    sys.stdout.write(text + "\n")
                    sys.stdout.flush()
                else:
                    os.write(self._terminal, data)
            except BrokenPipeError:  # `liftoff run | head`: the run goes on, logged, without a reader
                self._reader_gone = True

    def __enter__(self) -> Console:
        sys.stdout.flush()
        sys.stderr.flush()
        self._saved = (os.dup(1), os.dup(2))
        self._streams = (sys.stdout, sys.stderr)
        read_end, write_end = os.pipe()
        os.dup2(write_end, 1)
        os.dup2(write_end, 2)
        os.close(write_end)
        # the Python-level streams too: a test's capture replaces them with its own files
        sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115
        self._handlers = _point_log_handlers(self._streams, (sys.stdout, sys.stderr))
        self._terminal = self._saved[0]
        self._tty = os.isatty(self._terminal)
        self._log = open(self.log_path, "ab")  # noqa: SIM115
        self._reader = threading.Thread(target=self._read, args=(read_end,), name="liftoff-console", daemon=True)
        self._reader.start()
        return self

    def __exit__(self, *exc) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        for handler, stream in self._handlers:
            handler.setStream(stream)
        sys.stdout, sys.stderr = self._streams
        os.dup2(self._saved[0], 1)  # closes this process's write ends of the pipe: the reader sees EOF
        os.dup2(self._saved[1], 2)
        self._reader.join(timeout=10)
        self._terminal = None
        for fd in self._saved:
            os.close(fd)
        self._log.close()

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "rb") as pipe:
            for raw in iter(pipe.readline, b""):
                synced = raw.endswith(_SYNC)  # after a partial line (a progress bar's), too
                raw = raw[: -len(_SYNC)] if synced else raw
                if raw:
                    self._take(raw)
                if synced:
                    self._synced.set()

    def _take(self, raw: bytes) -> None:
        clean = plain(raw.decode(errors="replace"))  # kfp.local colours task names: not in a file
        self._log.write(clean.encode())
        self._log.flush()
        line = clean.rstrip("\n")
        self._lines.append(line)
        if self.verbose:
            with self._lock:
                if not self._reader_gone:
                    try:
                        os.write(self._terminal, raw if self._tty else clean.encode())
                    except BrokenPipeError:
                        self._reader_gone = True
        if (m := _SHOWN.search(line)) and (step := re.match(r"step (\d+)/", m.group(1) or "")):
            self.last_step = int(step.group(1))
        if m and not self.verbose:
            self.say("      " + (m.group(1) or m.group(2)))

    def sync(self) -> list[str]:
        """Wait until the reader has taken everything written so far; the lines since the last sync."""
        sys.stdout.flush()
        sys.stderr.flush()
        self._synced.clear()
        os.write(1, _SYNC)
        self._synced.wait(timeout=10)
        lines, self._lines = self._lines, []
        return lines


def _point_log_handlers(old: tuple, new: tuple) -> list:
    """Logging handlers writing to the streams being replaced, pointed at the new ones; what
    to set back."""
    import logging

    moved = []
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream in old:
            previous = handler.setStream(new[old.index(handler.stream)])
            moved.append((handler, previous))
    return moved


@dataclass
class StageEnd:
    name: str
    ok: bool
    seconds: float
    cached: bool
    outputs: dict = field(default_factory=dict)
    cause: str | None = None


@contextlib.contextmanager
def watch_stages(on_start: Callable[[str], None], on_end: Callable[[StageEnd, list[str]], None], sync):
    """Calls `on_start(task)` and `on_end(StageEnd, the task's log lines)` around every task
    kfp.local runs, from kfp.local's own task executor (the one place both of its DAG
    orchestrators start a task and get its outputs or failure back)."""
    try:
        from kfp.local.orchestrator import task_executor
    except ImportError:  # another kfp: no status lines, the run itself is unchanged
        yield
        return
    dispatcher = task_executor.task_dispatcher
    original, run_task = task_executor.execute_single_task, dispatcher.run_single_task_implementation
    ran = []

    def run(*args, **kwargs):  # not called for a task kfp.local's cache answers
        ran.append(True)
        return run_task(*args, **kwargs)

    def execute(*args, **kwargs):
        from pipelines.interrupt import STOPPING

        name = kwargs.get("task_name", args[0] if args else "?")
        if STOPPING.is_set():  # the run is being stopped: a ParallelFor thread starts nothing more
            raise RuntimeError(f"not starting {name}: the run is stopping")
        sync()
        on_start(name)
        ran.clear()
        t0 = time.perf_counter()
        outputs, status = original(*args, **kwargs)
        lines = sync()
        ok = getattr(status, "name", str(status)) == "SUCCESS"
        cause = None if ok else failure_cause(lines)
        on_end(StageEnd(name, ok, time.perf_counter() - t0, not ran, outputs or {}, cause), lines)
        return outputs, status

    task_executor.execute_single_task, dispatcher.run_single_task_implementation = execute, run
    try:
        yield
    finally:
        task_executor.execute_single_task, dispatcher.run_single_task_implementation = original, run_task


def failure_cause(lines: list[str]) -> str | None:
    """The exception a stage raised, from the traceback in its log: `Type: message`, a
    message's bullet lines joined on, the launcher's log tail left off."""
    lines = [ln[4:] if ln.startswith("    ") else ln for ln in lines]  # kfp.local indents a task's output
    start = next((i for i in range(len(lines) - 1, -1, -1) if lines[i].startswith("Traceback (most recent")), None)
    if start is None:
        return None
    header = next((i for i in range(start + 1, len(lines)) if lines[i] and not lines[i][0].isspace()), None)
    if header is None:
        return None
    kind, _, message = lines[header].partition(": ")
    text = f"{kind.rsplit('.', 1)[-1]}: {message}".rstrip()
    bullets = []
    for ln in lines[header + 1 :]:
        if not ln.startswith("- "):
            break
        bullets.append(ln[2:].strip())
    if bullets and text.endswith(":"):
        text += " " + "; ".join(bullets)
    return re.sub(r";?\s*last log lines:$", "", text)


def display_path(path: Path) -> str:
    """A path relative to the working directory when it lies under it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


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
