"""The error ``notebook_launcher`` and ``debug_launcher`` raise when a worker fails.

It is torch's ``ChildFailedError`` (what Accelerate's launchers raise, so code that catches it keeps
working), a ``RuntimeError`` (what lockstep raised before), and its message is lockstep's: one line per
failed rank naming the rank, the exception and the line of the user's code, instead of torch's banner.
"""

from __future__ import annotations

import os
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from lockstep.launcher.elastic import blame_order, describe_failure


class WorkerFailedError(ChildFailedError, RuntimeError):
    """A worker process of a launched function failed (``failures``: rank -> torch's ``ProcessFailure``).

    Example:
        >>> try:  # doctest: +SKIP
        ...     notebook_launcher(training_function, num_processes=2)
        ... except ChildFailedError as error:
        ...     print(error)  # A worker process failed:\\nrank 1 (local rank 1, pid 4242) failed ...
    """

    def get_first_failure(self) -> tuple[int, ProcessFailure]:
        """The root cause: the rank that failed first (torch's version compares whole seconds)."""
        return min(self.failures.items(), key=blame_order)

    def format_msg(self, boarder_delim: str = "=", section_delim: str = "-") -> str:
        lines = [
            describe_failure(rank, failure)
            for rank, failure in sorted(self.failures.items(), key=blame_order)
        ]
        return "A worker process failed:\n" + "\n".join(lines)


def with_every_recorded_failure(failures: dict[int, Any]) -> dict[int, Any]:
    """``failures`` plus every other rank of the same attempt that recorded an exception.

    With forked workers, torch's agent reports only the first process it finds dead, which is often not the
    one that failed first (when a rank raises, the others fail in their next collective, and all may be
    gone by the agent's next look). Each rank's record lies beside the reported one, ``<attempt>/<local
    rank>/error.json``; the records carry the time and pid, so the root cause can be named.
    """
    found = dict(failures)
    for rank, failure in failures.items():
        attempt_dir = os.path.dirname(os.path.dirname(str(failure.error_file)))
        if os.path.basename(str(failure.error_file)) != "error.json" or not os.path.isdir(attempt_dir):
            continue
        for entry in sorted(os.listdir(attempt_dir)):
            error_file = os.path.join(attempt_dir, entry, "error.json")
            other = rank - failure.local_rank + int(entry) if entry.isdigit() else None
            if other is None or other in found or not os.path.isfile(error_file):
                continue
            recorded = _recorded_failure(int(entry), error_file)
            if recorded is not None:
                found[other] = recorded
    return found


def _recorded_failure(local_rank: int, error_file: str) -> ProcessFailure | None:
    """A rank known only from its record (it raised, and exits with code 1 right after writing it); None
    when the record cannot be read (written by something other than lockstep's worker, which writes it
    whole): the failures already known are reported without it."""
    try:
        failure = ProcessFailure(local_rank=local_rank, pid=0, exitcode=1, error_file=error_file)
    except (OSError, ValueError):  # torch parses the file as it builds the failure (JSONDecodeError)
        return None
    message = failure.error_file_data.get("message")
    extra = message.get("extraInfo", {}) if isinstance(message, dict) else {}
    failure.pid = int(extra.get("lockstep_pid", 0))
    return failure
