"""What the resume tests share: a reproducible step to kill a rank at, and the line that says where
tests/scripts/resumable_train.py resumed."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.deadlines import scaled

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


def preempt(launch: list[str], script: str, project: Path, stop_after: int) -> tuple[int, str, str]:
    """Start ``lockstep LAUNCH SCRIPT PROJECT --step-delay 0.2``, send the launcher SIGTERM once the
    script's progress file reaches ``stop_after`` and check it exits 143. Returns the step the run stopped
    at, the newest checkpoint folder and the launcher's stdout."""
    from tests.helpers.cli import lockstep_popen

    launcher = lockstep_popen(*launch, script, str(project), "--step-delay", "0.2")
    progress = project / "progress"
    deadline = time.monotonic() + scaled(120)
    while time.monotonic() < deadline and not (
        progress.exists() and int(progress.read_text() or 0) >= stop_after
    ):
        time.sleep(0.02)
    launcher.send_signal(signal.SIGTERM)
    stdout, stderr = launcher.communicate(timeout=scaled(120))
    assert launcher.returncode == 143, stderr[-3000:]
    latest = (project / "checkpoints" / "latest").read_text().strip()
    return int(progress.read_text()), str(project / "checkpoints" / latest), stdout


def trained_ids(project: Path, samples: int) -> list[list[int]]:
    """Each step's sample ids (every process's, padding left out) that the job's weights were trained on, from
    the ``ids.jsonl`` lines tests/scripts/resumable_train.py appends, attempt after attempt: a resumed
    attempt's first line (step ``s``) replaces what the attempt before logged from step ``s`` on.

    Checks on the way that an attempt resumed mid-epoch reads the rest of that epoch, in order, as the attempt
    before read it after the same checkpoint: the epoch's order is the same on any number of processes, only
    its cut into steps differs. (The next epoch is drawn anew: on one process from torch's global generator,
    as a plain DataLoader does, whose state depends on the steps taken.)

    Args:
        project: the script's PROJECT_DIR.
        samples: the samples of an epoch.
    """
    steps: list[list[int]] = []
    redone: list[int] = []  # the rest of the epoch, as the attempt before read it after the checkpoint
    for number, line in enumerate((project / "ids.jsonl").read_text().splitlines()):
        record = json.loads(line)
        step, ids = record["step"], record["ids"]
        assert step - 1 <= len(steps), f"line {number}: step {step} logged after step {len(steps)}"
        if step - 1 < len(steps):  # a new attempt, resumed after step - 1
            rest = -sum(len(earlier) for earlier in steps[: step - 1]) % samples
            redone = [i for earlier in steps[step - 1 :] for i in earlier][:rest]
            del steps[step - 1 :]
        again, redone = redone[: len(ids)], redone[len(ids) :]
        assert ids[: len(again)] == again, (
            f"line {number}: step {step} read {ids}, where the attempt before read {again} after the same "
            "checkpoint"
        )
        steps.append(ids)
    return steps


def assert_each_sample_once_per_epoch(steps: list[list[int]], samples: int) -> None:
    """Every epoch of ``samples`` ids (the steps' ids, in order) holds each sample once; the last epoch, cut
    short by the end of training, holds distinct ones."""
    ids = [i for step in steps for i in step]
    for start in range(0, len(ids), samples):
        epoch = ids[start : start + samples]
        where = f"epoch {start // samples} (ids {start} to {start + len(epoch) - 1} of {len(ids)})"
        if len(epoch) == samples:
            assert sorted(epoch) == list(range(samples)), f"{where}: {epoch}"
        else:
            assert len(set(epoch)) == len(epoch), f"{where} repeats samples: {epoch}"


def checkpoint_folder(project: Path, index: int) -> str:
    return str(project / "checkpoints" / f"checkpoint_{index}")


STEPS, SAVE_EVERY = 12, 3  # tests/scripts/resumable_train.py's defaults


def preempt_then_kill(
    name: str, first: list[str], again: list[str], script: str, project: Path
) -> tuple[str, str]:
    """One job through both interruptions: ``lockstep FIRST`` is preempted at a drawn step (exit 143, a
    checkpoint at the step it stopped), then ``lockstep AGAIN --max-restarts 1`` resumes it with seed 1 and
    rank 1 is SIGKILLed at a later drawn step, after the resumed attempt has saved a checkpoint of its own;
    the restarted attempt (seed 2) resumes from that one. Checks the exit codes, the checkpoint and every
    attempt's resume line; returns both launches' stdout (the second's ``PARAMS`` line is the job's weights)."""
    import torch

    from tests.helpers.cli import lockstep

    stop_after, drawn = draw_step(f"{name} preemption", 2, 4)
    stopped_at, latest, first_stdout = preempt(first, script, project, stop_after)
    saved = torch.load(Path(latest) / "custom_checkpoint_0.pkl", weights_only=True)
    # the checkpoint is at the step where the run stopped
    assert saved["done"] == stopped_at, (
        f"{drawn}: stopped at {stopped_at}, {latest} holds step {saved['done']}"
    )
    first_save = (stopped_at // SAVE_EVERY + 1) * SAVE_EVERY  # the resumed attempt's first checkpoint
    assert first_save < STEPS - 1, f"{drawn}: stopped at {stopped_at}, too late to kill a rank after a save"
    die_at, drawn_kill = draw_step(f"{name} killed rank", first_save + 1, STEPS - 1)
    drawn = f"{drawn}; stopped at {stopped_at}; {drawn_kill}"
    again = [*again, "--max-restarts", "1", script, str(project), "--seed", "1", "--die-at", str(die_at)]
    result = lockstep(*again)
    assert result.returncode == 0, f"{drawn}: {result.stderr[-3000:]}"
    resumed_at = last_checkpoint_before(die_at, SAVE_EVERY)
    # the folders are numbered on: the regular saves before the stop, the stop's, then the resumed attempt's
    index = (stopped_at - 1) // SAVE_EVERY + (resumed_at - first_save) // SAVE_EVERY + 1
    assert resumed_lines(result.stdout) == [
        Resumed(attempt=0, seed=1, folder=latest, step=stopped_at),
        Resumed(attempt=1, seed=2, folder=checkpoint_folder(project, index), step=resumed_at),
    ], f"{drawn}:\n{result.stdout[-3000:]}"
    return first_stdout, result.stdout
