"""Shared by the benchmarks: run a worker script on CPU processes under torchrun, read its JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def user_env(**extra: str) -> dict[str, str]:
    """The environment of a user's run: one thread per process and bytecode caching on (this workplace
    sets PYTHONDONTWRITEBYTECODE=1, which would make lockstep recompile its sources in every process)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def reserved_port() -> int:
    """A port for a launcher that must be told one (the launch-time row measures plain torchrun, static
    rendezvous): tests/helpers/ports.py's, which no other process can take before the launcher binds it.
    Prefer :data:`TORCHRUN` where the rendezvous does not matter."""
    if str(REPO) not in sys.path:
        sys.path.append(str(REPO))
    from tests.helpers.ports import reserved_port as reserve

    return reserve()


TORCHRUN = ["-m", "torch.distributed.run", "--standalone"]
"""torchrun on this machine alone, after ``python``: its agent binds a free port itself, so a run never races
another process for a port chosen beforehand (one chosen by binding port 0 and released was taken by another
test's process in a CI run, and the peers' step worker failed with EADDRINUSE)."""


def run_script(script: str | Path, *args: str, processes: int = 2) -> dict:
    """Run ``script`` on ``processes`` processes (torchrun when more than one, plain Python for one);
    returns the JSON object rank 0 printed last."""
    if processes == 1:
        command = [sys.executable, str(script), *args]
    else:
        command = [sys.executable, *TORCHRUN, "--nproc_per_node", str(processes), str(script), *args]
    output = subprocess.run(command, env=user_env(), check=True, capture_output=True, text=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def run_worker(worker: str, *args: str, processes: int = 2) -> dict:
    """Run ``bench/<worker>`` (see :func:`run_script`)."""
    return run_script(Path(__file__).with_name(worker), *args, processes=processes)
