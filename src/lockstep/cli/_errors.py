"""How the command line reports bad input: one clear line and exit code 2, never a traceback."""

from __future__ import annotations

import sys
from typing import NoReturn

from lockstep.errors import UsageError

EXIT_USAGE = 2

__all__ = ["EXIT_USAGE", "UsageError", "fail"]


def fail(command: str, message: str) -> NoReturn:
    """Print ``lockstep COMMAND: error: MESSAGE`` to stderr and exit with code 2."""
    print(f"lockstep {command}: error: {message}", file=sys.stderr)
    raise SystemExit(EXIT_USAGE)
