"""What the resume tests share: a reproducible step to kill a rank at, and the line that says where
tests/scripts/resumable_train.py resumed."""

from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass

SEED_VARIABLE = "LOCKSTEP_RESUME_TEST_SEED"
"""Set it to draw other steps; a failing test prints the seed it drew with."""

_RESUMED = re.compile(r"^attempt (\d+) \(seed (-?\d+)\) resumed from (\S+) at step (\d+)$", re.MULTILINE)


def draw_step(test: str, low: int, high: int) -> tuple[int, str]:
    """A step in [low, high] drawn from a seeded generator (per test, so each test draws its own), and
    the words that say how to draw it again. The draw is printed (pytest shows it when the test fails)."""
    seed = int(os.environ.get(SEED_VARIABLE, "31"))
    step = random.Random(f"{test}:{seed}").randint(low, high)
    how = f"{test}: step {step} drawn from [{low}, {high}] with {SEED_VARIABLE}={seed}"
    print(how)
    return step, how


def last_checkpoint_before(step: int, save_every: int) -> int:
    """The step of the newest checkpoint a rank killed at ``step`` leaves: it dies before saving at its own
    step, so the last commit is the multiple of ``save_every`` below it."""
    return (step - 1) // save_every * save_every


@dataclass(frozen=True)
class Resumed:
    """The script's `attempt K (seed S) resumed from FOLDER at step N` line."""

    attempt: int
    seed: int
    folder: str
    step: int


def resumed_lines(stdout: str) -> list[Resumed]:
    """Every attempt's line, in order (one per attempt that reached its resume)."""
    return [
        Resumed(int(attempt), int(seed), folder, int(step))
        for attempt, seed, folder, step in _RESUMED.findall(stdout)
    ]


def final_params(stdout: str) -> list[float]:
    """The `PARAMS [...]` line the script prints at the end."""
    return json.loads(next(line for line in stdout.splitlines() if line.startswith("PARAMS "))[7:])
