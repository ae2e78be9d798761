"""Waits of the tests on other processes stretch with the machine's load (issue 44, item 7): a wait written
for an idle machine failed the fault-tolerance and hang-diagnosis tests at a load average of 30."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from tests.helpers import deadlines

TESTS = Path(__file__).resolve().parent


def test_the_factor_is_the_load_per_core_between_1_and_the_cap(monkeypatch):
    monkeypatch.delenv(deadlines.FACTOR_ENV, raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    for load, factor in [(0.5, 1.0), (2.0, 1.0), (6.0, 3.0), (30.0, 10.0)]:
        monkeypatch.setattr("os.getloadavg", lambda load=load: (load, 0.0, 0.0))
        assert deadlines.load_factor() == factor
        assert deadlines.scaled(60) == 60 * factor


def test_the_environment_overrides_the_factor(monkeypatch):
    monkeypatch.setattr("os.getloadavg", lambda: (30.0, 0.0, 0.0))
    monkeypatch.setenv(deadlines.FACTOR_ENV, "1")
    assert deadlines.scaled(60) == 60
    monkeypatch.setenv(deadlines.FACTOR_ENV, "slow")
    with pytest.raises(
        ValueError, match=r"LOCKSTEP_TEST_TIMEOUT_FACTOR='slow' is invalid: it must be a number"
    ):
        deadlines.load_factor()
    monkeypatch.setenv(deadlines.FACTOR_ENV, "0")
    with pytest.raises(ValueError, match=r"LOCKSTEP_TEST_TIMEOUT_FACTOR='0' is invalid: it must be > 0"):
        deadlines.load_factor()


def test_wait_for_returns_what_the_condition_found():
    polls = itertools.count()
    assert deadlines.wait_for(lambda: next(polls) >= 3 and "found", 5, "three polls", interval=0) == "found"


def test_wait_for_stretches_its_deadline_while_the_load_rises(monkeypatch):
    """1 s idle; the load rises to 4 times the cores during the wait: it waits 4 s, and says so."""
    clock = itertools.count(0.0, 0.5)
    loads = iter([1.0] * 2 + [8.0] * 100)
    monkeypatch.delenv(deadlines.FACTOR_ENV, raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    monkeypatch.setattr("os.getloadavg", lambda: (next(loads), 0.0, 0.0))
    monkeypatch.setattr(deadlines.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(deadlines.time, "sleep", lambda _: None)
    with pytest.raises(
        AssertionError,
        match=r"^group 2's second step: not within 4 s \(1 s on an idle machine, times 4.0 for",
    ):
        deadlines.wait_for(lambda: None, 1, "group 2's second step")
    assert next(clock) == 5.0  # gave up at the first poll past 4 s


_LITERAL_WAIT = re.compile(
    r"monotonic\(\) \+ [0-9]|\.(wait|communicate|join)\((timeout=)?[0-9]+(\.[0-9]+)?\)"
)
_ALLOWED = {
    "helpers/multiprocess.py": "the join after every worker reported: ending processes that already answered",
    "scripts/worker_facts.py": "the worker's own cap on waiting for the test, longer than any test wait",
    "launcher/test_notebook_launcher.py": "an event between two threads of one kernel, not another process",
    "checkpoint/test_durable_background.py": "events between threads of the test process",
    "test_helpers_forking.py": "events between threads of the test process",
    "test_helpers_deadlines.py": "this check's own examples",
}


def test_waits_on_other_processes_go_through_the_deadlines():
    """A literal wait on a process (``.wait(60)``, ``communicate(timeout=60)``, ``monotonic() + 60``) does
    not stretch under load: write ``scaled(60)`` or ``wait_for(..., 60, ...)``."""
    found = [
        f"{relative}:{number}: {line.strip()}"
        for path in sorted(TESTS.rglob("*.py"))
        if (relative := path.relative_to(TESTS).as_posix()) not in _ALLOWED
        and not relative.startswith(("e2e/trainer_scripts/", "e2e/no_trainer/"))  # transformers' scripts
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if _LITERAL_WAIT.search(line)
    ]
    assert found == []
