"""A failure names its cause (issue 21): in a real 2-node launch, rank 1 raises `NotFound` and
rank 0 then dies of the lost connection; the one line (the LaunchError's first, and what
`liftoff run` prints of it) names rank 1's NotFound and calls rank 0's error a consequence."""

from __future__ import annotations

import re

import pytest

from components import events
from components.launcher import LaunchError
from pipelines.progress import failure_cause
from tests.faults import RAISED_VERSION, injected
from tests.helpers import TWO_NODES

SHORT = ["train.steps=8", "train.warmup_steps=2", "train.checkpoint_interval=100", "cluster.max_restarts=0"]
NOT_FOUND = f"NotFound: no version {RAISED_VERSION} of checkpoint/tiny in the store"


def test_the_one_line_failure_names_the_rank_that_failed_first(trainer, capsys):
    with injected(raise_rank=1, raise_step=3), pytest.raises(LaunchError) as failed:
        trainer.run(*TWO_NODES, *SHORT)
    first = str(failed.value).splitlines()[0]
    head = r"^train-\w{8} ended FAILED; first failure: replica 1 rank 1 at \d\d:\d\d:\d\d\.\d{3}: "
    assert re.match(head + re.escape(NOT_FOUND) + r" \(replica 0 rank 0 failed after it: ", first), first
    assert "Connection closed" not in first.split(" (replica 0 rank 0 failed after it: ")[0]
    assert first.endswith("; last log lines:")
    # the last log lines are the first failing replica's: its own traceback is among them
    assert any("NotFound" in ln and ln.startswith("  | ") for ln in str(failed.value).splitlines()[1:])

    # what `liftoff run` prints: kfp.local's task log (the replicas' streamed lines, their
    # tracebacks among them), then the `failed` event the stage's stage_task hands back for it
    streamed = capsys.readouterr().out.splitlines()
    assert any("[rank0]: RuntimeError" in ln for ln in streamed), "rank 0 did not die of its own error"
    handed_back = events.line("failed", stage="train", **events.failure_fields(failed.value))
    cause = failure_cause([f"    {ln}" for ln in [*streamed, handed_back]])
    assert cause == "LaunchError: " + first.removesuffix("; last log lines:"), cause


def _report(rank: int, at: float, kind: str, message: str) -> str:

    from components import events

    record = {"rank": str(rank), "time": at, "type": kind, "message": message}
    return f"[0]:2026-12-02 11:02:03,123 rank{rank} ERROR liftoff.failure: {events.line('rank_failed', **record)}"


def _root_cause_block(rank: int, at: float, exitcode: str, traceback_lines: list[str]) -> list[str]:
    """torchrun's agent's ChildFailedError summary, as torch.distributed.elastic formats it."""
    from datetime import datetime

    when = datetime.fromtimestamp(at).isoformat(sep="_", timespec="seconds")
    body = "\n  ".join(traceback_lines) if traceback_lines else "To enable traceback see: https://pytorch.org/docs"
    return [
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "=" * 60,
        "components.train.worker FAILED",
        "-" * 60,
        "Failures:",
        "  <NO_OTHER_FAILURES>",
        "-" * 60,
        "Root Cause (first observed failure):",
        "[0]:",
        f"  time      : {when}",
        "  host      : node-1",
        f"  rank      : {rank} (local_rank: 0)",
        f"  exitcode  : {exitcode}",
        "  error_file: <N/A>",
        *f"  traceback : {body}".split("\n"),
        "=" * 60,
    ]


def _failures(logs: dict[int, list[str]]):
    from components.failures import _reported_failure, first_failures

    reported = {k: [f for ln in lines if (f := _reported_failure(k, ln))] for k, lines in logs.items()}
    return first_failures(logs, reported)


def test_a_rank_killed_by_a_signal_comes_before_the_peer_that_lost_it():
    """Rank 1 is OOM-killed (no exception, no report: only torchrun's block, to the second);
    rank 0 reports its lost connection 0.4 s into the next second. The kill is the cause."""
    t = 1796214013.0  # a whole second: torchrun saw the kill at t + 0.9, printed as t
    logs = {
        0: [_report(0, t + 1.4, "RuntimeError", "[pair.cc:553] Connection closed by peer [10.0.0.2]:29500")],
        1: _root_cause_block(1, t, "-9 (pid: 4242) Signal 9 (SIGKILL) received by PID 4242", []),
    }
    first, after = _failures(logs)
    assert (first.replica, first.rank, first.cause, first.exact) == (1, "1", "killed by SIGKILL (exit code -9)", False)
    assert re.fullmatch(r"replica 1 rank 1 at \d\d:\d\d:\d\d: killed by SIGKILL \(exit code -9\)", first.describe())
    assert after.brief() == "RuntimeError: Connection closed by peer [10.0.0.2]:29500"


def test_a_rank_its_agent_stopped_comes_after_the_exception_that_stopped_it():
    """procs_per_node=2: local rank 0 (rank 2) raises; its agent SIGTERMs rank 3 in the same
    second. torchrun's block for rank 3 must not outrank rank 2's exact report."""
    t = 1796214013.0
    logs = {
        1: [
            _report(2, t + 0.7, "ValueError", "train.log_interval must be positive"),
            *_root_cause_block(3, t, "-15 (pid: 77) Signal 15 (SIGTERM) received by PID 77", []),
        ]
    }
    first, after = _failures(logs)
    assert (first.rank, first.cause) == ("2", "ValueError: train.log_interval must be positive")
    assert (after.rank, after.cause) == ("3", "killed by SIGTERM (exit code -15)")


def test_torchruns_block_gives_the_exception_of_a_rank_that_could_not_report_it():
    """A rank without its own report line (it died before the launcher's hook was in place)
    still has its exception named, from the traceback @record's error file gave torchrun: the
    outermost of a chain, its message's indented lines joined onto its first."""
    t = 1796214013.0
    tb = [
        "Traceback (most recent call last):",
        '  File "components/train/data.py", line 3, in plan',
        "ZeroDivisionError: division by zero",
        "",
        "The above exception was the direct cause of the following exception:",
        "",
        "Traceback (most recent call last):",
        '  File "components/train/worker.py", line 9, in main',
        "components.train.data.DataFitError: the dataset does not fit:",
        "  - 4 blocks per rank, 8 needed",
    ]
    logs = {0: _root_cause_block(0, t, "1 (pid: 9)", tb)}
    (first,) = _failures(logs)
    assert first.cause == "DataFitError: the dataset does not fit: 4 blocks per rank, 8 needed"
    # the same block in a pod's log, each line after the API's timestamp
    (from_pod,) = _failures({0: [f"2026-12-02T11:02:03.123456789Z {ln}" for ln in logs[0]]})
    assert from_pod == first


def test_a_watchdogs_stack_dump_is_kept_whole_in_the_log_tail():
    """The stacks after a `rank_failed` record that says they follow survive the tail (up to 3n
    lines), with the newest lines after them; other events never reach the quoted tail."""
    from components.failures import log_tail

    record = {"rank": "1", "time": 1796214013.0, "type": "WatchdogTimeout", "message": "no progress for 9s"}
    stacks = [f'  File "worker.py", line {i}, in step' for i in range(30)]
    lines = [f"step {i}" for i in range(50)] + [_report_line(record, stacks_follow=True), *stacks]
    lines += [events.line("step", step=99)] + [f"after {i}" for i in range(10)]
    tail = log_tail(lines, 5)
    assert tail[0] == "rank 1: WatchdogTimeout: no progress for 9s; its stacks:"
    assert tail[1:15] == stacks[:14] and tail[15] == "..." and tail[16:] == [f"after {i}" for i in range(5, 10)]
    assert not any("liftoff-event" in ln for ln in tail)


def _report_line(record: dict, **extra) -> str:
    return f"[0]:2026-12-02 11:02:03,123 rank1 ERROR liftoff.failure: {events.line('rank_failed', **record, **extra)}"
