"""The one way tests fork worker processes, and the guard on the forks scripts make themselves.

A fork copies the memory of every thread but runs only the forking one: a lock another thread held at
that moment (an allocator's, the logging module's, libgomp's, a gloo or store thread's) stays held in the
child for ever, and the worker hangs until the test's timeout. Forking is still what the suite wants
(``run_distributed``'s workers inherit the imported torch, dynamo and DeepSpeed instead of paying seconds
each to import them), so every fork goes through here:

* :func:`worker_context` gives ``run_distributed`` the ``fork`` context (its workers must inherit the test's
  set-up; see there why not a forkserver);
* :func:`fork` is ``os.fork`` for a script that forks children itself; it refuses while a thread runs.

Threads are read from ``/proc/self/task``: torch's and gloo's threads are invisible to ``threading``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from typing import Any

GRACE = 2.0
"""How long a fork waits for threads that are ending (a store's server thread after ``del store``)."""


def _tasks() -> set[int]:
    try:
        return {int(task) for task in os.listdir("/proc/self/task")}
    except OSError:
        return set()


RUNNER_THREADS = frozenset(_tasks() - {threading.get_native_id()})
"""The threads that ran before any test (tests/conftest.py imports this module first): the test runner's own,
pytest-xdist's execnet channel thread in a worker. They never touch what a worker uses (torch, gloo, the
logging module), so a fork may copy them; every thread started after them counts."""


def other_threads() -> list[str]:
    """The names of this process's threads other than the calling one and the test runner's
    (:data:`RUNNER_THREADS`); empty where /proc is missing."""
    names = []
    for task in sorted(_tasks() - RUNNER_THREADS):
        if task == threading.get_native_id():
            continue
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:  # it ended meanwhile
            continue
    return sorted(names)


def threads_after_grace() -> list[str]:
    """:func:`other_threads`, after waiting up to :data:`GRACE` seconds for them to end."""
    deadline = time.monotonic() + GRACE
    while (threads := other_threads()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return threads


def worker_context(target: Any = None) -> mp.context.BaseContext:
    """The multiprocessing context ``run_distributed`` starts workers running ``target`` with: ``fork``.

    Workers must inherit what the test process set up: the registrations a test makes (a user backend, a
    tracker), fixtures' module state, test-local functions, imported torch. A forkserver fallback while
    threads run (the test runner's, jemalloc's, a Ray or lighthouse client's) lost all of that: it failed 10
    tests in CI (a user backend unknown to the workers, test-local functions that cannot be pickled), and
    that run took 3,662 s against 2,364 s at the stop before (each fallback waited 2 s, then started a server
    that imports torch; not measured apart). Forking beside those threads passed every CI run before it;
    :func:`fork` guards the forks scripts make themselves.
    """
    del target
    return mp.get_context("fork")


def fork() -> int:
    """``os.fork()``, refused while another thread of this process runs.

    Raises:
        RuntimeError: naming the threads still running after :data:`GRACE` seconds.
    """
    threads = threads_after_grace()
    if threads:
        raise RuntimeError(
            f"refusing to fork: this process runs threads {threads}; the child could inherit a lock one of "
            "them holds and hang. Fork before they start, or after they end."
        )
    return os.fork()
