"""How long a test waits for work of other processes: a base time, stretched by the machine's load.

A wait written for an idle machine (a 60 s wait for another process's step) fails when the CI machine
runs the suite beside other jobs: at a load average of 30 on 2 cores each process gets a fifteenth of a
core, and the fault-tolerance kill test and the hang-diagnosis tests failed so. Every wait of a test on
other processes goes through here: :func:`scaled` for a timeout handed to ``subprocess``, a queue or
``run_distributed``; :func:`wait_for` for a polling loop, whose deadline keeps stretching while the load
rises during the wait.

Only the test's own waits and margins scale. A number the product promises (a hang window, a quorum
timeout) stays what the test passes to the product; a test that checks the product keeps it, and scales
only the margin it allows the machine on top (``10 + scaled(20)``).

``LOCKSTEP_TEST_TIMEOUT_FACTOR`` overrides the factor (``3`` on a machine known to be slow; ``1`` to see
the idle figures).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

FACTOR_ENV = "LOCKSTEP_TEST_TIMEOUT_FACTOR"
MAX_FACTOR = 10.0
"""A hang still fails the test, at most ten times its base wait (the CI job's own limit is 90 minutes)."""

T = TypeVar("T")


def load_factor() -> float:
    """How many times slower than idle this machine runs now: the 1-minute load average per core, at
    least 1 and at most :data:`MAX_FACTOR`; :data:`FACTOR_ENV` when set."""
    override = os.environ.get(FACTOR_ENV, "").strip()
    if override:
        try:
            value = float(override)
        except ValueError:
            raise ValueError(
                f"{FACTOR_ENV}={override!r} is invalid: it must be a number (how many times the base waits "
                "to allow), e.g. 3"
            ) from None
        if not value > 0:
            raise ValueError(f"{FACTOR_ENV}={override!r} is invalid: it must be > 0")
        return value
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average on this platform
        return 1.0
    return min(MAX_FACTOR, max(1.0, load / (os.cpu_count() or 1)))


def scaled(seconds: float) -> float:
    """``seconds``, the wait on an idle machine, times the load factor now."""
    return seconds * load_factor()


def wait_for(
    condition: Callable[[], T | None],
    seconds: float,
    what: str,
    *,
    interval: float = 0.01,
) -> T:
    """Poll ``condition`` until it returns something truthy, and return that.

    The deadline is ``seconds`` times the highest load factor seen since the wait began (the load of a
    2-core machine climbs while the test's own processes start). Raises ``AssertionError`` naming ``what``
    and both figures when it passes. ``condition`` may raise to end the wait early (a process it waits on
    exited).
    """
    start = time.monotonic()
    factor = load_factor()
    while True:
        found = condition()
        if found:
            return found
        factor = max(factor, load_factor())
        if time.monotonic() - start > seconds * factor:
            raise AssertionError(
                f"{what}: not within {seconds * factor:.0f} s ({seconds:g} s on an idle machine, times "
                f"{factor:.1f} for the load; {FACTOR_ENV} overrides the factor)"
            )
        time.sleep(interval)
