"""Chaos tests: each records the fault it injects, what should happen and what did; the
table prints at the end of the run (`make chaos`)."""

from __future__ import annotations

import os
import signal
import socket
import threading
from pathlib import Path

import pytest

_ROWS: list[dict] = []


class ChaosRecord:
    def __init__(self, fault: str, expected: str):
        self.row = {"fault": fault, "expected": expected, "happened": "", "outcome": "not run"}
        _ROWS.append(self.row)

    def happened(self, text: str) -> None:
        self.row["happened"] = text


@pytest.fixture
def chaos(request):
    records: list[ChaosRecord] = []

    def record(fault: str, expected: str) -> ChaosRecord:
        rec = ChaosRecord(fault, expected)
        records.append(rec)
        return rec

    yield record
    report = getattr(request.node, "rep_call", None)
    for rec in records:
        rec.row["outcome"] = "passed" if report is not None and report.passed else "FAILED"


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call":
        item.rep_call = rep


def pytest_terminal_summary(terminalreporter):
    if not _ROWS:
        return
    tr = terminalreporter
    tr.section("chaos summary")
    tr.write_line("| fault | expected | happened | result |")
    tr.write_line("|---|---|---|---|")
    for r in _ROWS:
        tr.write_line(f"| {r['fault']} | {r['expected']} | {r['happened'] or '-'} | {r['outcome']} |")


class TcpProxy:
    """A loopback TCP forwarder that can be taken down and brought back on the same port,
    so the S3 server behind it keeps its state through an "outage"."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.port = 0
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        lst = socket.socket()
        lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lst.bind(("127.0.0.1", self.port))
        lst.listen(64)
        self.port = lst.getsockname()[1]
        self._listener = lst
        threading.Thread(target=self._accept, args=(lst,), daemon=True).start()

    def _accept(self, lst: socket.socket) -> None:
        while True:
            try:
                client, _ = lst.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        with self._lock:
            for c in self._conns:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                    c.close()
                except OSError:
                    pass
            self._conns.clear()


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL a process and everything it started (TorchX replicas live in their own sessions)."""
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
