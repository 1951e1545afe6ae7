"""A stop stops everything: SIGINT or SIGTERM to `liftoff run` ends every process the run started.

The run's processes are not all in its process group: TorchX starts each replica in a session
of its own, so Ctrl-C never reaches them, and a signal to the CLI alone reaches nothing else.
So the CLI makes itself the child subreaper (orphans of its tree are re-parented to it, not
to PID 1, and stay findable), and on a signal it sends SIGTERM to its whole tree (a KFP task
cancels its TorchX job and releases its lease; torchrun agents and workers end), waits a
grace period, SIGKILLs whatever is left and reaps it. Then `Interrupted` unwinds the run.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

_PR_SET_CHILD_SUBREAPER = 36
GRACE_S = 5.0  # for a driver to cancel its job and release its lease; the whole stop stays under 10 s


STOPPING = threading.Event()  # set once a stop began: no new task may start (kfp.local's ParallelFor threads)


class Interrupted(BaseException):  # noqa: N818 - not an error: the user stopped the run
    """The run was stopped by a signal; `line` says where it was and what a rerun does."""

    def __init__(self, signum: int, line: str):
        super().__init__(line)
        self.signum, self.line = signum, line


def become_subreaper() -> bool:
    """Linux: orphaned descendants are re-parented to this process instead of init."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _parents() -> dict[int, int]:
    """pid -> parent pid of every live (not zombie) process, from /proc."""
    parents = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # after "(comm)", which may hold spaces
        if fields and fields[0] != "Z":
            parents[int(entry)] = int(fields[1])
    return parents


def descendants(root: int | None = None) -> list[int]:
    """Every live process below `root` (this process), children before grandchildren."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    for pid, ppid in _parents().items():
        children.setdefault(ppid, []).append(pid)
    found, frontier = [], [root]
    while frontier:
        nxt = [c for p in frontier for c in children.get(p, [])]
        found += nxt
        frontier = nxt
    return found


def _signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


def _reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def stop_tree(grace_s: float = GRACE_S) -> None:
    """SIGTERM to every descendant, then SIGKILL to any left after `grace_s`; all reaped."""
    _signal_all(descendants(), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        _reap()
        if not descendants():
            return
        time.sleep(0.1)
    for _ in range(20):  # a process may fork while we kill: until none is left
        left = descendants()
        if not left:
            break
        _signal_all(left, signal.SIGKILL)
        time.sleep(0.05)
        _reap()


@contextlib.contextmanager
def stopped_by_signals(describe: Callable[[], str]) -> Iterator[None]:
    """Within the block SIGINT and SIGTERM stop the run's whole process tree and raise
    `Interrupted` with `describe()`'s line (where the run was, what a rerun does)."""
    become_subreaper()

    def stop(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        STOPPING.set()
        stop_tree()
        try:
            line = describe()
        except Exception as e:  # the stop itself matters more than its description
            line = f"interrupted ({type(e).__name__} while describing where: {e})"
        raise Interrupted(signum, line)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    STOPPING.clear()
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
