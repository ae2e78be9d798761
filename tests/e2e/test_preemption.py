"""A killed rank or a preemption loses nothing: the job ends with the weights of an uninterrupted run.

The resumed attempt is seeded differently (other initial weights, dropout and data order): starting over, or
a load that restores nothing, cannot reach the uninterrupted run's weights, and the step it resumed at is
checked exactly."""

import signal
import time

import pytest

from lockstep.accelerator.preemption import PreemptionWatcher, parse_signals
from tests.helpers.cli import SCRIPTS
from tests.helpers.in_process_launch import launched_in_process
from tests.helpers.resume import final_params, preempt_then_kill

pytestmark = pytest.mark.distributed

SCRIPT = str(SCRIPTS / "resumable_train.py")


@pytest.mark.slow
def test_a_preempted_run_resumes_and_a_killed_rank_restarts_to_the_uninterrupted_weights(tmp_path):
    """Preempted (exit 143), resumed, a rank killed and restarted: the job's weights are exactly those of an
    uninterrupted run, which runs in workers forked from this process (its launch is not what is tested)."""
    launch = ["launch", "--num-processes", "2"]
    _, stdout = preempt_then_kill("ddp", launch, launch, SCRIPT, tmp_path)
    straight = tmp_path / "straight"
    straight.mkdir()
    reference = launched_in_process(launch[1:], SCRIPT, [str(straight)])
    assert final_params(stdout) == final_params(reference[0])


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
