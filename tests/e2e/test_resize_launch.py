"""Sharded layouts under real `lockstep launch` jobs, resized: a job on 3 processes loses rank 1 to SIGKILL at
a seeded step; the relaunch on 2 (standing for the elastic restart on the machines left) resumes the newest
checkpoint at its step and trains to the end. ZeRO-2 and ZeRO-3 convert it with DeepSpeed's universal
checkpoint (the conversion beside the checkpoint is deleted once loaded); FSDP2's 3 DCP shards are resharded
by torch.distributed.checkpoint.

What the conversion restores (master weights and Adam moments bit-equal, the next steps within 1e-6 of an
unresized continuation) is checked in tests/backends/test_deepspeed_resize.py, and every sample once with
the weights of a replay in tests/data/test_resize_resume.py; this test checks the path a user takes: the
launcher, a killed job's leftovers, `resume_from_latest_checkpoint()`, the restart line, and that the steps
the weights were trained on read every sample of an epoch once (the resumed job continues the epoch where the
checkpoint left it, on its new number of processes).
"""

from __future__ import annotations

import pytest

from tests.helpers.cli import SCRIPTS, lockstep
from tests.helpers.optional import requires
from tests.helpers.resume import (
    assert_each_sample_once_per_epoch,
    draw_step,
    last_checkpoint_before,
    resumed_lines,
    trained_ids,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPT = str(SCRIPTS / "resumable_train.py")
SAVE_EVERY, STEPS = 3, 12


LAYOUTS = {
    "zero2": (["--zero-stage", "2"], "DEEPSPEED zero 2"),
    "zero3": (["--zero-stage", "3", "--zero3-save-16bit-model", "true"], "DEEPSPEED zero 3"),
    # FSDP2's sharded checkpoint (3 DCP shards) is resharded by torch.distributed.checkpoint on 2
    "fsdp2": (["--use-fsdp", "--fsdp-version", "2", "--fsdp-auto-wrap-policy", "NO_WRAP"], "FSDP"),
}


@pytest.mark.parametrize(
    "layout",
    [pytest.param(name, marks=[requires("deepspeed")] if "zero" in name else []) for name in LAYOUTS],
)
def test_a_sharded_job_killed_on_three_processes_continues_on_two(tmp_path, layout):
    project = tmp_path / "run"
    project.mkdir()
    die_at, drawn = draw_step(f"{layout} resize", SAVE_EVERY + 1, STEPS - 1)
    saved = last_checkpoint_before(die_at, SAVE_EVERY)
    zero, distributed = LAYOUTS[layout]
    job = [SCRIPT, str(project), "--optimizer", "adamw"]
    first = lockstep("launch", "--num-processes", "3", *zero, *job, "--die-at", str(die_at), timeout=300)
    assert first.returncode != 0 and "killed by SIGKILL" in first.stderr, f"{drawn}: {first.stderr[-3000:]}"
    folder = project / "checkpoints" / (project / "checkpoints" / "latest").read_text().strip()
    if layout == "fsdp2":  # saved sharded by 3, read by 2
        assert len(list((folder / "pytorch_model_fsdp_0").glob("*.distcp"))) == 3, drawn
    second = lockstep("launch", "--num-processes", "2", *zero, *job, "--seed", "1", timeout=300)
    assert second.returncode == 0, f"{drawn}: {second.stderr[-3000:]}"
    [resumed] = resumed_lines(second.stdout)
    assert (resumed.folder, resumed.step) == (str(folder), saved), (drawn, second.stdout[-2000:])
    assert "attempt 0 world 2" in second.stdout and f"distributed {distributed}" in second.stdout
    line = f"resumed on 2 processes from a checkpoint saved on 3: {folder} after {saved} optimizer steps, "
    per_epoch = -(-64 // 12)  # optimizer steps of 12 samples (4 per process) in an epoch, the last one padded
    samples = f"epoch {saved // per_epoch}, {12 * (saved % per_epoch)} of 64 samples of the epoch consumed"
    assert line in second.stderr and samples in second.stderr, (drawn, second.stderr[-3000:])
    assert int((project / "progress").read_text()) == STEPS
    steps = trained_ids(project, 64)  # the killed job's steps up to the checkpoint, then the resumed job's
    assert len(steps) == STEPS, drawn
    assert_each_sample_once_per_epoch(steps, 64)  # resumed at the sample after the checkpoint's last
    assert not list((project / "checkpoints").glob("*.universal"))  # the conversion was deleted
