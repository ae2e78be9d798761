"""Tests start worker processes one way, which never forks a process while another of its threads runs
(issue 44, item 7): a forked child keeps, held for ever, every lock another thread held at the fork."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import pytest

from tests.helpers import forking
from tests.helpers.multiprocess import run_distributed

TESTS = Path(__file__).resolve().parent

_LOCK = threading.Lock()


def _parent_and_lock() -> tuple[int, bool]:
    """In a worker: who started it, and whether the module's lock can be taken."""
    taken = _LOCK.acquire(timeout=2)
    if taken:
        _LOCK.release()
    return os.getppid(), taken


@pytest.fixture
def thread_holding_the_lock():
    release = threading.Event()
    held = threading.Event()

    def hold() -> None:
        with _LOCK:
            held.set()
            release.wait(60)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    held.wait(10)
    try:
        yield
    finally:
        release.set()
        thread.join()


@pytest.mark.distributed
def test_the_workers_are_forked_from_the_test_process():
    """They inherit the test's set-up (registrations, test-local functions): no forkserver."""
    assert run_distributed(_parent_and_lock, 2) == [(os.getpid(), True)] * 2


def test_fork_is_refused_while_a_thread_runs(thread_holding_the_lock, monkeypatch):
    monkeypatch.setattr(forking, "GRACE", 0.0)
    with pytest.raises(RuntimeError, match=r"refusing to fork: this process runs threads \['"):
        forking.fork()


_FORKS = re.compile(r"""get_context\(\s*["']fork["']\s*\)|\bos\.fork\(|\b(mp|multiprocessing)\.Process\(""")


def test_no_test_forks_except_through_the_helper():
    """``run_distributed`` (through ``worker_context``) and ``forking.fork`` are the only ways tests fork."""
    allowed = {TESTS / "helpers" / "forking.py", Path(__file__).resolve()}
    found = [
        f"{path.relative_to(TESTS)}:{number}: {line.strip()}"
        for path in TESTS.rglob("*.py")
        if path not in allowed
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if _FORKS.search(line)
    ]
    assert found == []
