"""The error ``notebook_launcher`` and ``debug_launcher`` raise when a worker fails.

It is torch's ``ChildFailedError`` (what Accelerate's launchers raise, so code that catches it keeps
working), a ``RuntimeError`` (what lockstep raised before), and its message is lockstep's: one line per
failed rank naming the rank, the exception and the line of the user's code, instead of torch's banner.
"""

from __future__ import annotations

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from lockstep.launcher.elastic import describe_failure


class WorkerFailedError(ChildFailedError, RuntimeError):
    """A worker process of a launched function failed (``failures``: rank -> torch's ``ProcessFailure``).

    Example:
        >>> try:  # doctest: +SKIP
        ...     notebook_launcher(training_function, num_processes=2)
        ... except ChildFailedError as error:
        ...     print(error)  # A worker process failed:\\nrank 1 (local rank 1, pid 4242) failed ...
    """

    def format_msg(self, boarder_delim: str = "=", section_delim: str = "-") -> str:
        lines = [describe_failure(rank, failure) for rank, failure in sorted(self.failures.items())]
        return "A worker process failed:\n" + "\n".join(lines)
