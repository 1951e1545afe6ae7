"""Typed hand-backs (issue 26): a stage's process hands its driver events, and `liftoff run`
words what it shows from those, never from another module's log text."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from components import events
from pipelines.progress import failure_cause, shown_lines
from tests.conftest import ROOT


def run_stage(body: str) -> subprocess.CompletedProcess:
    """A stage_task block in a process of its own, as a KFP task runs one."""
    code = "from components.task import stage_task\nwith stage_task('validate'):\n" + textwrap.indent(body, "    ")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_a_stage_hands_back_its_compute_time_or_the_exception_it_ended_with():
    done = run_stage("sum(range(10**6))")
    assert done.returncode == 0, done.stderr
    (compute,) = events.events(done.stdout.splitlines())
    assert compute.kind == "compute" and compute["stage"] == "validate" and compute["seconds"] >= 0

    config = "raise ValueError('config problems:\\n- train.steps: must be positive\\n- data.seq_len: too long\\nmore')"
    failed = run_stage(config)
    assert failed.returncode == 1 and "Traceback" in failed.stderr
    (event,) = events.events(failed.stdout.splitlines())
    assert (event.kind, event["stage"], event["type"]) == ("failed", "validate", "ValueError")
    # kfp.local indents a task's output: what `liftoff run` prints of it
    lines = [f"    {ln}" for ln in failed.stdout.splitlines()]
    expected = "ValueError: config problems: train.steps: must be positive; data.seq_len: too long; more"
    assert failure_cause(lines) == expected


def test_a_launch_errors_cause_leaves_the_log_tail_out():
    """The launcher's message quotes the failing replica's last lines; its `failed` event
    carries the cause alone, as the launcher built it (not cut out of the message)."""
    from components.failures import describe_failure

    report = events.line("rank_failed", rank="1", time=1796214013.0, type="NotFound", message="no version x")
    from components.failures import _reported_failure

    tails = {1: ["booting", report, "bye"]}
    head, message, _ = describe_failure("train-1", None, tails, 5, {1: [_reported_failure(1, report)]})
    assert message.startswith(head + "; last log lines:\n") and "  | bye" in message
    code = f"from components.launcher import LaunchError\nraise LaunchError({message!r}, summary={head!r})"
    failed = run_stage(code)
    assert failure_cause(failed.stdout.splitlines()) == f"LaunchError: {head}"
    assert "first failure: replica 1 rank 1" in head and "NotFound: no version x" in head


def test_only_events_are_shown_and_a_truncated_or_foreign_line_is_none():
    step = {"step": 3, "steps": 10, "loss": 5.25, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 1234.5, "mfu": None}
    step |= {"peak_memory_gib": 0.5, "memory_fraction": 0.01, "step_s": 0.25, "eta_s": 3725.0}
    lines = [
        "12:00:00 rank0 INFO components.train.worker: step 3/10  loss 5.2500 (a log line: not shown)",
        "    [0]:" + events.line("step", **step),
        events.line("step", **step)[:-5],  # cut off mid-record
        'liftoff-event ["not", "a", "record"]',
        events.line("training", nodes=2),  # fields missing (another version's event): not shown, no error
        events.line("step", **{**step, "eta_s": float("nan")}),  # NaN travels as null
        events.line("step", **step).replace('"eta_s": 3725.0', '"eta_s": 1e400'),  # infinite: not shown, no error
        events.line("relaunch", job="train-ab", attempt=1, attempts=2, cause="RuntimeError: boom"),
    ]
    assert shown_lines(lines) == [
        "step 3/10  loss 5.2500  1,234 tokens/s  0.50 GiB  0.250 s/step  ETA 1:02:05",
        "step 3/10  loss 5.2500  1,234 tokens/s  0.50 GiB  0.250 s/step  ETA 0:00:00",
        "train-ab failed (attempt 1 of 2); relaunching: RuntimeError: boom",
    ]
