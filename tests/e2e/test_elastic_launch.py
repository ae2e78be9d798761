"""An elastic job: `lockstep launch --num-machines 1:2` on two launchers over loopback (standing for two
machines), one of them lost (its launcher and workers killed with SIGKILL mid-run): the survivor's workers
restart on the smaller world, resume from the newest checkpoint, and the job ends with exit 0, its steps
having read every sample of each epoch once."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.cli import REPO, cli_env, lockstep
from tests.helpers.deadlines import scaled
from tests.helpers.ports import reserved_port
from tests.helpers.resume import assert_each_sample_once_per_epoch, resumed_lines, trained_ids

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPT = "tests/scripts/resumable_train.py"
STEPS = 30
# A short last call: a round closes 3 s after its first machine arrives; a lost peer is declared dead after
# 2 missed 1-second heartbeats (torch's defaults are 30 s and 3 x 5 s).
RDZV_CONF = "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=2,join_timeout=120"


def _machine(port: int, project: str, log: Path, *, hosts_store: bool) -> subprocess.Popen:
    command = [sys.executable, "-m", "lockstep.cli.main", "launch", "--num-machines", "1:2"]
    command += ["--num-processes", "2", "--main-process-ip", "127.0.0.1", "--main-process-port", str(port)]
    command += [
        "--rdzv-conf",
        f"{RDZV_CONF},is_host={str(hosts_store).lower()}",
        "--max-restarts",
        "3",
        SCRIPT,
        project,
        "--steps",
        str(STEPS),
    ]
    command += ["--step-delay", "0.25"]
    with open(log.with_suffix(".out"), "w") as out, open(log.with_suffix(".err"), "w") as err:
        # files, not pipes: nobody reads a pipe while the job runs
        return subprocess.Popen(command, cwd=REPO, env=cli_env(), stdout=out, stderr=err)


def _lose_machine(launcher: subprocess.Popen) -> None:
    """SIGKILL the launcher and its workers at once (torch's agent starts each worker in a process group of its
    own, so the launcher's group alone would leave them running)."""
    children = subprocess.run(
        ["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True
    ).stdout.split()
    for pid in [launcher.pid, *map(int, children)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    launcher.wait()


def _worlds(stdout: str) -> list[tuple[int, int]]:
    return [(int(a), int(w)) for a, w in re.findall(r"^attempt (\d+) world (\d+)$", stdout, re.MULTILINE)]


def test_a_lost_machine_leaves_the_survivor_training_alone_to_the_end(tmp_path):
    port, project = reserved_port(), str(tmp_path / "run")  # the second machine must be told it
    (tmp_path / "run").mkdir()
    first = _machine(port, project, tmp_path / "first", hosts_store=True)
    # Both "machines" are this host, so both would take themselves for the rendezvous host (torch compares the
    # endpoint with the host's names); is_host says which one is, as the hostnames would on two machines.
    second = _machine(port, project, tmp_path / "second", hosts_store=False)
    progress = tmp_path / "run" / "progress"
    deadline = time.monotonic() + scaled(180)
    while time.monotonic() < deadline and not (progress.exists() and int(progress.read_text() or 0) >= 8):
        time.sleep(0.05)
    assert progress.exists(), "the job never trained"
    _lose_machine(second)
    second.communicate()
    first.wait(timeout=scaled(240))
    stdout, stderr = ((tmp_path / f"first.{kind}").read_text() for kind in ("out", "err"))
    assert first.returncode == 0, stderr[-4000:]
    worlds = _worlds(stdout)
    assert (0, 2) in worlds or any(world == 2 for _, world in worlds), stdout[-3000:]
    assert worlds[-1][1] == 1, worlds  # the last attempt ran alone
    last = resumed_lines(stdout)[-1]
    assert last.attempt == worlds[-1][0] and last.step >= 6 and last.folder != "None", stdout[-3000:]
    assert int(progress.read_text()) == STEPS
    steps = trained_ids(tmp_path / "run", 64)  # each attempt's steps up to where the next one resumed
    assert len(steps) == STEPS
    assert_each_sample_once_per_epoch(steps, 64)  # each attempt resumed at the sample after its checkpoint


def test_bad_machine_ranges_are_refused_before_any_process_starts():
    for given, message in [
        ("3:2", "--num-machines 3:2 is invalid: MIN (3) is larger than MAX (2)"),
        ("0:2", "--num-machines 0:2 is invalid: the fewest machines must be >= 1"),
        ("1:x", "--num-machines '1:x' is invalid: give a number of machines"),
    ]:
        result = lockstep("launch", "--num-machines", given, "--num-processes", "2", SCRIPT, "x")
        assert result.returncode == 2 and message in result.stderr, (given, result.stderr)
    result = lockstep(
        "launch", "--nnodes", "1:2", "--rdzv-backend", "static", "--num-processes", "2", SCRIPT, "x"
    )
    assert result.returncode == 2
    assert "--num-machines 1:2 is an elastic job, which needs torch's c10d rendezvous" in result.stderr
