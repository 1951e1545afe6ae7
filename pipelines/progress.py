"""What `liftoff run` shows while it runs: the capture of everything its processes print, the
lines it words from the typed events they hand back (components/events.py: what trains, its
steps, a relaunch after a failure, the exception a stage ended with), and each kfp.local
task's start and end (pipelines/summary.py words them). Everything else the run prints
(kfp.local's task logs, every replica's log lines, C++ and library output of the processes it
starts) goes to the run's log file, and with `-v` to the terminal as well."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from components import events
from components.events import Event

_SYNC = b"\x00liftoff-sync\n"  # written through the captured stream: everything before it has been read
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def plain(text: str) -> str:
    return _ANSI.sub("", text)


def shown(event: Event) -> str | None:
    """The line the quiet output shows for an event (None: not shown)."""
    f = event.fields
    if event.kind == "training":
        how = f["precision_said"]  # the precision recipe's own words for what it made of the model
        blocks = f"{f['activation_checkpointed']}/{f['blocks']} blocks checkpointed ({f['checkpointing']}), "
        blocks += f"{f['compiled']} compiled"
        where = f"{f['nodes']} node(s) x {f['procs_per_node']} process(es) on {f['device']}"
        return f"{where}: {how}; {blocks}; {f['wrapper']}"
    if event.kind == "step":
        mfu = f"  MFU {f['mfu']:.1%}" if f.get("mfu") is not None else ""
        left = round(f["eta_s"] or 0)
        eta = f"{left // 3600}:{left % 3600 // 60:02d}:{left % 60:02d}"
        tokens = f"{f['tokens_per_s']:,.0f} tokens/s{mfu}  {f['peak_memory_gib']:.2f} GiB"
        return f"step {f['step']}/{f['steps']}  loss {f['loss']:.4f}  {tokens}  {f['step_s']:.3f} s/step  ETA {eta}"
    if event.kind == "relaunch":
        return f"{f['job']} failed (attempt {f['attempt']} of {f['attempts']}); relaunching: {f['cause']}"
    return None


def shown_safely(event: Event) -> str | None:
    """`shown`, and None for an event it cannot word (one of another liftoff version: logged)."""
    try:
        return shown(event)
    except (KeyError, TypeError, ValueError, ArithmeticError):  # ArithmeticError: an infinite ETA
        return None


def shown_lines(lines: list[str]) -> list[str]:
    """What the quiet output shows of a run's captured lines (as `Console` shows them live)."""
    return [text for e in events.events(lines) if (text := shown_safely(e)) is not None]


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
        if (event := events.parse(line)) is None:
            return
        text = shown_safely(event)
        if event.kind == "step" and isinstance(event.get("step"), int):
            self.last_step = event["step"]
        if not self.verbose and text is not None:
            self.say("      " + text)

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
    """The exception a stage ended with, `Type: message`, from the `failed` event its
    stage_task handed back (the last, should a task's output hold several)."""
    failed = events.events(lines, "failed")
    return f"{failed[-1].get('type', 'Error')}: {failed[-1].get('message', '')}" if failed else None


def display_path(path: Path) -> str:
    """A path relative to the working directory when it lies under it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)
