"""A finished run exits 0 every time: gloo must not abort the interpreter at exit (pytorch#190489)."""

import os
import subprocess
import sys

import pytest

from tests.helpers.cli import SCRIPTS
from tests.helpers.deadlines import scaled
from tests.helpers.ports import held_store
from tests.helpers.soak import soak_runs

pytestmark = pytest.mark.distributed

SCRIPT = SCRIPTS / "ddp_exit.py"
RUNS = soak_runs(1)


def _run_pair(script=SCRIPT, *args: str, **extra_env: str) -> list[tuple[int, str]]:
    with held_store(2) as store:  # the test holds the store's port, the ranks join it
        return _start_pair(store, script, *args, **extra_env)


def _start_pair(store: dict[str, str], script, *args: str, **extra_env: str) -> list[tuple[int, str]]:
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="2",
            **store,
            OMP_NUM_THREADS="1",
            **extra_env,
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=scaled(120))
        results.append((proc.returncode, out + err))
    return results


@pytest.mark.slow
def test_ddp_run_exits_cleanly_every_time():
    failures = []
    for attempt in range(RUNS):
        for rank, (code, output) in enumerate(_run_pair()):
            if code != 0 or "terminate called" in output:
                failures.append(f"run {attempt} rank {rank}: exit {code}\n{output[-2000:]}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("own_group", ["0", "1"])
def test_the_group_outlives_end_training_and_is_torn_down_at_exit(tmp_path, own_group):
    """transformers' examples synchronise and save after end_training(); Accelerate has destroyed the group
    by then. The group lockstep made, or the one the script made itself, goes down at exit, exit code 0."""
    path = tmp_path / "model.pt"
    results = _run_pair(SCRIPTS / "after_end_training.py", str(path), LOCKSTEP_TEST_OWN_GROUP=own_group)
    for code, output in results:
        assert code == 0 and "terminate called" not in output, output[-2000:]
    assert "after end_training: reduce=2" in results[0][1]
    assert path.is_file()
