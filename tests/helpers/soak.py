"""How often the reliability tests repeat a run.

The suite runs each once by default: a regression that fails most runs shows there, and other tests in the
suite already go through the same path (the resume tests restart a group after a killed rank, the
end_training tests exit a DDP pair the same way), so CI time (shared) is not spent repeating it. Set
``LOCKSTEP_SOAK_RUNS=20`` for a soak that shows a rare failure (the figures in the closing notes of the
launcher and shutdown work came from 10 and 20 runs).
"""

from __future__ import annotations

import os


def soak_runs(default: int) -> int:
    value = os.environ.get("LOCKSTEP_SOAK_RUNS", "")
    return int(value) if value.strip().isdigit() and int(value) > 0 else default
