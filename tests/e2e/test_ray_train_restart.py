"""lockstep inside Ray Train (examples/ray_torch_trainer.py): a worker killed mid-run makes Ray restart the
group, and lockstep resumes from its checkpoint in Ray's storage path to the weights of an uninterrupted run.

Ray runs in a subprocess (tests/scripts/ray_resume.py), never in the pytest process, on a local cluster of
2 CPUs whose every process lives under its own temporary folder: the test checks that none is left, even
when the run fails. The uninterrupted run is the same training function on 2 forked gloo processes
(lockstep's own group instead of Ray's), a few seconds: the Ray run costs about 100 CPU-seconds over 21
processes (4 workers at ~11 s each, mostly importing torch and ray.train; the controller and its actors), and
a second TorchTrainer run would add about 48 more (measured with Ray 2.60 on 2 cores).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.helpers.cli import REPO, SCRIPTS, cli_env
from tests.helpers.deadlines import scaled
from tests.helpers.multiprocess import run_distributed
from tests.helpers.optional import requires
from tests.helpers.resume import draw_step, last_checkpoint_before

pytestmark = [pytest.mark.distributed, requires("ray")]

EXAMPLE = REPO / "examples" / "ray_torch_trainer.py"
SAVE_EVERY = 3  # fit()'s default
DRIVER_TIMEOUT = 420  # 200 s measured on 2 cores under a load of 8


def _train_loop():
    spec = importlib.util.spec_from_file_location("ray_torch_trainer", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.train_loop


def _uninterrupted(project_dir: Path) -> dict:
    config = {"project_dir": str(project_dir), "steps": 12, "save_every": SAVE_EVERY, "seed": 0}
    return run_distributed(_train_loop(), 2, {**config, "kill_worker_at": -1})[0]


MARKER = "LOCKSTEP_TEST_RAY_CLUSTER"
"""Set in the driver's environment; every process of its Ray cluster inherits it (workers rename their
command line to ``ray::...``, so the environment is what identifies them)."""


def _cluster_processes(tag: str) -> list[str]:
    """``pid: command`` of every running process whose environment carries ``MARKER=tag``."""
    needle = f"{MARKER}={tag}".encode() + b"\0"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle not in (entry / "environ").read_bytes() + b"\0":
                continue
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it ended meanwhile, or is another user's
            continue
        found.append(f"{entry.name}: {command[:160]}")
    return found


def _run_driver(storage: Path, ray_dir: str, kill_at: int) -> subprocess.CompletedProcess:
    command = [sys.executable, str(SCRIPTS / "ray_resume.py"), str(storage), ray_dir, str(kill_at)]
    env = cli_env(
        RAY_TRAIN_HEALTH_CHECK_INTERVAL_S="0.5", RAY_TRAIN_ENABLE_PREEMPTION_WATCHER="0", **{MARKER: ray_dir}
    )
    driver = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        stdout, stderr = driver.communicate(timeout=scaled(DRIVER_TIMEOUT))
    except subprocess.TimeoutExpired:
        os.killpg(driver.pid, signal.SIGKILL)  # Ray's processes share the driver's session
        stdout, stderr = driver.communicate()
        stderr += f"\n(the driver did not finish within {DRIVER_TIMEOUT} s and was killed)"
    return subprocess.CompletedProcess(command, driver.returncode, stdout, stderr)


def _wait_until_gone(tag: str, seconds: float = 20.0) -> list[str]:
    deadline = time.monotonic() + scaled(seconds)
    while (left := _cluster_processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.mark.slow
def test_worker_killed_under_ray_train_resumes_to_the_weights_of_an_uninterrupted_run(tmp_path):
    kill_at, drawn = draw_step("ray killed worker", SAVE_EVERY + 1, 11)
    # Ray's sockets live under its temporary folder, whose path must stay short (107 bytes in all).
    ray_dir = tempfile.mkdtemp(prefix="lockstep-ray-", dir="/tmp")
    try:
        result = _run_driver(tmp_path / "storage", ray_dir, kill_at)
        left = _wait_until_gone(ray_dir)
    finally:
        for line in _cluster_processes(ray_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split(":")[0]), signal.SIGKILL)
        shutil.rmtree(ray_dir, ignore_errors=True)
    assert result.returncode == 0, f"{drawn}: {result.stderr[-4000:]}"
    assert left == [], f"Ray processes left after ray.shutdown(): {left}"
    summary = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))[7:])
    resumed_at = last_checkpoint_before(kill_at, SAVE_EVERY)
    checkpoint = (
        tmp_path / "storage" / "killed" / "checkpoints" / f"checkpoint_{resumed_at // SAVE_EVERY - 1}"
    )
    assert (summary["world"], summary["device"]) == (2, "cpu")
    assert (summary["resumed_from"], summary["resumed_at"]) == (str(checkpoint), resumed_at), drawn
    assert summary["params"] == _uninterrupted(tmp_path / "straight")["params"], drawn
