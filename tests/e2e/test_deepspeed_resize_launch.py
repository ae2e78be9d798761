"""ZeRO-2 and ZeRO-3 under real `lockstep launch` jobs, resized: a job on 3 processes loses rank 1 to SIGKILL at a seeded
step; the relaunch on 2 (standing for the elastic restart on the machines left) converts the newest
checkpoint with DeepSpeed's universal checkpoint, resumes at its step and trains to the end; the conversion
beside the checkpoint is deleted once loaded.

What the conversion restores (master weights and Adam moments bit-equal, the next steps within 1e-6 of an
unresized continuation) is checked in tests/backends/test_deepspeed_resize.py, on ZeRO-2 and ZeRO-3; this
test checks the path a user takes: the launcher, a killed job's leftovers, `resume_from_latest_checkpoint()`.
"""

from __future__ import annotations

import pytest

from tests.helpers.cli import SCRIPTS, lockstep
from tests.helpers.optional import requires
from tests.helpers.resume import draw_step, last_checkpoint_before, resumed_lines

pytestmark = [pytest.mark.distributed, pytest.mark.slow, requires("deepspeed")]

SCRIPT = str(SCRIPTS / "resumable_train.py")
SAVE_EVERY, STEPS = 3, 12


@pytest.mark.parametrize("stage", [2, 3])
def test_a_zero_job_killed_on_three_processes_continues_on_two(tmp_path, stage):
    project = tmp_path / "run"
    project.mkdir()
    die_at, drawn = draw_step(f"zero-{stage} resize", SAVE_EVERY + 1, STEPS - 1)
    saved = last_checkpoint_before(die_at, SAVE_EVERY)
    zero = ["--zero-stage", str(stage)] + (["--zero3-save-16bit-model", "true"] if stage == 3 else [])
    job = [SCRIPT, str(project), "--optimizer", "adamw"]
    first = lockstep("launch", "--num-processes", "3", *zero, *job, "--die-at", str(die_at), timeout=300)
    assert first.returncode != 0 and "killed by SIGKILL" in first.stderr, f"{drawn}: {first.stderr[-3000:]}"
    folder = project / "checkpoints" / (project / "checkpoints" / "latest").read_text().strip()
    second = lockstep("launch", "--num-processes", "2", *zero, *job, "--seed", "1", timeout=300)
    assert second.returncode == 0, f"{drawn}: {second.stderr[-3000:]}"
    [resumed] = resumed_lines(second.stdout)
    assert (resumed.folder, resumed.step) == (str(folder), saved), (drawn, second.stdout[-2000:])
    assert "attempt 0 world 2" in second.stdout and f"distributed DEEPSPEED zero {stage}" in second.stdout
    line = f"resumed on 2 processes from a checkpoint saved on 3: {folder} after {saved} optimizer steps, "
    per_epoch = -(-64 // 12)  # optimizer steps of 12 samples (4 per process) in an epoch, the last one padded
    samples = f"epoch {saved // per_epoch}, {12 * (saved % per_epoch)} of 64 samples of the epoch consumed"
    assert line in second.stderr and samples in second.stderr, (drawn, second.stderr[-3000:])
    assert int((project / "progress").read_text()) == STEPS
    assert not list((project / "checkpoints").glob("*.universal"))  # the conversion was deleted
