"""A finished run exits 0 every time: gloo must not abort the interpreter at exit (pytorch#190489)."""

import os
import subprocess
import sys

import pytest

from tests.helpers.cli import SCRIPTS
from tests.helpers.multiprocess import free_port
from tests.helpers.soak import soak_runs

pytestmark = pytest.mark.distributed

SCRIPT = SCRIPTS / "ddp_exit.py"
RUNS = soak_runs(6)


def _run_pair() -> list[tuple[int, str]]:
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(SCRIPT)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
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
