"""How the command line reports bad input: one clear line and exit code 2, never a traceback."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

from lockstep.errors import UsageError

EXIT_USAGE = 2

__all__ = ["EXIT_USAGE", "UsageError", "fail", "warnings_as_lines"]


def fail(command: str, message: str) -> NoReturn:
    """Print ``lockstep COMMAND: error: MESSAGE`` to stderr and exit with code 2."""
    print(f"lockstep {command}: error: {message}", file=sys.stderr)
    raise SystemExit(EXIT_USAGE)


@contextmanager
def warnings_as_lines(command: str) -> Iterator[None]:
    """Show warnings (e.g. ignored keys) as ``lockstep COMMAND: warning: ...`` lines, not source dumps."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        finally:
            for warning in caught:
                print(f"lockstep {command}: warning: {warning.message}", file=sys.stderr)
