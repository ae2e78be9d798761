"""Shared by the benchmarks: run a worker script on CPU processes under torchrun, read its JSON line."""

from __future__ import annotations

import json
import os
import socket
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
    """A loopback port for a launcher that must be told one (the launch-time row measures plain torchrun,
    static rendezvous), which no other process gets before the launcher binds it: bound, connected to and
    closed from the accepting side, it stays in TIME_WAIT for a minute, where the kernel hands it to no one
    binding port 0 and refuses it to binds without ``SO_REUSEADDR``, while torch's TCPStore (which sets it)
    binds it at once. The same remedy as the test suite's ``tests/helpers/ports.py``, kept here so that the
    benchmarks run without the tests. Prefer :data:`TORCHRUN` where the rendezvous does not matter."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the TIME_WAIT socket inherits it
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = server.accept()
            client.getsockname()  # established both ways before either side closes
            accepted.close()  # the accepting side closes first: the TIME_WAIT is on the server's port
    return int(port)


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
