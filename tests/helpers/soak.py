"""How often the reliability tests repeat a run.

The suite repeats each twice, which catches a regression that fails most runs (CI time is shared); set
``LOCKSTEP_SOAK_RUNS=20`` for a soak that shows a rare failure (the figures in the closing notes of
the launcher and shutdown work came from 10 and 20 runs).
"""

from __future__ import annotations

import os


def soak_runs(default: int) -> int:
    value = os.environ.get("LOCKSTEP_SOAK_RUNS", "")
    return int(value) if value.strip().isdigit() and int(value) > 0 else default
