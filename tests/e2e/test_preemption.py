"""A killed rank or a preemption loses nothing: the job ends with the weights of an uninterrupted run.

The resumed attempt is seeded differently (other initial weights, dropout and data order): starting over, or
a load that restores nothing, cannot reach the uninterrupted run's weights, and the step it resumed at is
checked exactly."""

import signal
import time

import pytest

from lockstep.accelerator.preemption import PreemptionWatcher, parse_signals
from tests.helpers.cli import SCRIPTS, lockstep, lockstep_popen
from tests.helpers.resume import Resumed, draw_step, final_params, last_checkpoint_before, resumed_lines

pytestmark = pytest.mark.distributed

SCRIPT = str(SCRIPTS / "resumable_train.py")
SAVE_EVERY = 3  # the script's default


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[float]:
    result = lockstep("launch", "--num-processes", "2", SCRIPT, str(tmp_path_factory.mktemp("straight")))
    assert result.returncode == 0, result.stderr
    return final_params(result.stdout)


@pytest.mark.slow
def test_killed_rank_restarts_and_matches_an_uninterrupted_run(tmp_path, uninterrupted):
    die_at, drawn = draw_step("ddp killed rank", 4, 11)  # after the first checkpoint (step 3)
    result = lockstep(
        "launch",
        "--num-processes",
        "2",
        "--max-restarts",
        "1",
        SCRIPT,
        str(tmp_path),
        "--die-at",
        str(die_at),
    )
    assert result.returncode == 0, f"{drawn}: {result.stderr[-3000:]}"
    resumed_at = last_checkpoint_before(die_at, SAVE_EVERY)
    folder = str(tmp_path / "checkpoints" / f"checkpoint_{resumed_at // SAVE_EVERY - 1}")
    assert resumed_lines(result.stdout) == [
        Resumed(attempt=0, seed=0, folder="None", step=0),
        Resumed(attempt=1, seed=1, folder=folder, step=resumed_at),
    ], f"{drawn}:\n{result.stdout[-3000:]}"
    assert final_params(result.stdout) == uninterrupted, drawn


@pytest.mark.slow
def test_preempted_run_saves_exits_143_and_resumes_exactly(tmp_path, uninterrupted):
    stop_after, drawn = draw_step("ddp preemption", 2, 8)
    launcher = lockstep_popen("launch", "--num-processes", "2", SCRIPT, str(tmp_path), "--step-delay", "0.2")
    progress = tmp_path / "progress"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (
        progress.exists() and int(progress.read_text() or 0) >= stop_after
    ):
        time.sleep(0.02)
    launcher.send_signal(signal.SIGTERM)
    _, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == 143, stderr[-3000:]
    stopped_at = int(progress.read_text())
    latest = (tmp_path / "checkpoints" / "latest").read_text().strip()
    import torch

    saved = torch.load(tmp_path / "checkpoints" / latest / "custom_checkpoint_0.pkl", weights_only=True)
    assert saved["done"] == stopped_at  # the checkpoint is at the step where the run stopped
    result = lockstep("launch", "--num-processes", "2", SCRIPT, str(tmp_path), "--seed", "1")
    assert result.returncode == 0, f"{drawn}: {result.stderr[-3000:]}"
    assert resumed_lines(result.stdout) == [
        Resumed(attempt=0, seed=1, folder=str(tmp_path / "checkpoints" / latest), step=stopped_at)
    ], f"{drawn}:\n{result.stdout[-3000:]}"
    assert final_params(result.stdout) == uninterrupted, drawn


def test_watcher_agrees_and_reports():
    watcher = PreemptionWatcher(["SIGUSR1"], grace_period=0.01)
    import torch

    assert not watcher.should_stop(torch.device("cpu"))
    signal.raise_signal(signal.SIGUSR1)
    assert watcher.should_stop(torch.device("cpu")) and watcher.exit_code == 128 + signal.SIGUSR1
    time.sleep(0.02)
    assert "longer than the 0 s grace period" in watcher.report_save(3.0)
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)


def test_bad_signal_names():
    with pytest.raises(ValueError, match="preemption_signals got 'SIGNOPE', which is not a signal"):
        parse_signals(["SIGNOPE"])
