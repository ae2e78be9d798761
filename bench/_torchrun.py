"""Shared by the benchmarks: run a worker script on 2 CPU processes under torchrun, read its JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def user_env(**extra: str) -> dict[str, str]:
    """The environment of a user's run: one thread per process and bytecode caching on (this workplace
    sets PYTHONDONTWRITEBYTECODE=1, which would make lockstep recompile its sources in every process)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def torchrun_command(script: str | Path, port: int, *args: str, processes: int = 2) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(processes),
        "--master_port",
        str(port),
        str(script),
        *args,
    ]


def run_worker(worker: str, port: int, *args: str) -> dict:
    """Run ``bench/<worker>`` on 2 processes; returns the JSON object rank 0 printed last."""
    script = Path(__file__).with_name(worker)
    output = subprocess.run(
        torchrun_command(script, port, *args), env=user_env(), check=True, capture_output=True, text=True
    ).stdout
    return json.loads(output.strip().splitlines()[-1])
