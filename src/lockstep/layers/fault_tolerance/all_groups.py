"""``lockstep launch --fault-tolerance --replica-group all``: every replica group on this machine.

The launch starts (or joins) the lighthouse, then runs the same command once per group, each a launch of
its own (its own elastic agent, rendezvous port, restarts and workers) told its group's number and the
lighthouse through the environment. A group that fails for good leaves the others training, as separate
launches would; the launch ends when every group has ended, with the first failed group's exit code (0 when
all succeeded). SIGTERM and SIGINT are passed on to every group, whose launches stop their workers.

This is the way to try a fault-tolerant job on one machine (a laptop, CPU processes): kill one group's
worker and watch the others keep stepping while its launch restarts it (``--max-restarts``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

GROUP_ENV = "LOCKSTEP_FT_GROUP_OF_ALL"
"""Set for each group's launch: its replica group's number."""
LIGHTHOUSE_ENV = "LOCKSTEP_FT_LIGHTHOUSE_OF_ALL"
"""Set for each group's launch: the lighthouse every group joins."""


def group_of_this_launch() -> tuple[int, str] | None:
    """(group, lighthouse) when this launch is one group of ``--replica-group all``; else None."""
    group, lighthouse = os.environ.get(GROUP_ENV), os.environ.get(LIGHTHOUSE_ENV)
    if group is None or lighthouse is None:
        return None
    return int(group), lighthouse


def run_every_group(groups: int, lighthouse: str, settings: Any = None) -> int:
    """Run this launch's command once per group and wait for all; the first failed group's exit code."""
    command = [sys.executable, "-m", "lockstep.cli.main", *sys.argv[1:]]
    environment = {**os.environ, LIGHTHOUSE_ENV: lighthouse}
    threads = _threads_per_process(groups, settings)
    if threads is not None:
        environment["OMP_NUM_THREADS"] = str(threads)
    launches = [
        # A session of its own: a terminal's Ctrl-C reaches the group once, passed on from here.
        subprocess.Popen(command, env={**environment, GROUP_ENV: str(group)}, start_new_session=True)
        for group in range(groups)
    ]
    print(
        f"lockstep launch: started replica groups 0-{groups - 1} (pids "
        f"{', '.join(str(p.pid) for p in launches)}), each a launch of its own, around {lighthouse}",
        file=sys.stderr,
        flush=True,
    )
    with _passing_on_stop_signals(launches):
        codes = [launch.wait() for launch in launches]
    for group, code in enumerate(codes):
        if code != 0:
            print(f"lockstep launch: replica group {group} ended with exit code {code}", file=sys.stderr)
    return next((code for code in codes if code != 0), 0)


def _threads_per_process(groups: int, settings: Any) -> int | None:
    """``OMP_NUM_THREADS`` shared out over every group's processes, unless the user set the threads."""
    if "OMP_NUM_THREADS" in os.environ or getattr(settings, "num_cpu_threads_per_process", None):
        return None
    processes = int(getattr(settings, "processes_per_machine", 1) or 1)
    return max(1, (os.cpu_count() or 1) // (groups * processes))  # as the launcher shares out one group's


@contextlib.contextmanager
def _passing_on_stop_signals(launches: list[subprocess.Popen]) -> Iterator[None]:
    """While inside, SIGTERM and SIGINT received here are sent on to every group's launch."""

    def pass_on(number: int, _frame: Any) -> None:
        for launch in launches:
            if launch.poll() is None:
                launch.send_signal(number)

    previous = {number: signal.signal(number, pass_on) for number in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
