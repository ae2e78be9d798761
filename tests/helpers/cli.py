"""Running the real ``lockstep`` command in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.deadlines import scaled

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "tests" / "scripts"


CLUSTER_PREFIXES = ("SLURM_", "PET_", "OMPI_", "PMI_", "MPI_LOCAL", "LSB_", "JSM_NAMESPACE_", "PBS_")
"""Variables of schedulers and cluster launchers, which ``lockstep launch`` reads: tests that run inside a
job (``srun pytest``) launch as on a plain machine, unless a test sets them."""


def cli_env(**extra: str) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith(CLUSTER_PREFIXES)}
    env.pop("OMP_NUM_THREADS", None)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("LOCKSTEP_HOME", str(REPO / ".pytest_cache" / "lockstep_home_empty"))
    env.update(extra)
    return env


def lockstep(
    *args: str, timeout: float = 180, env: dict[str, str] | None = None, **kwargs
) -> subprocess.CompletedProcess:
    """Run ``lockstep ARGS`` (as ``python -m lockstep.cli.main``) and capture its output; ``timeout`` is the
    wait on an idle machine, scaled by the load (:mod:`tests.helpers.deadlines`)."""
    return subprocess.run(
        [sys.executable, "-m", "lockstep.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=scaled(timeout),
        env=env or cli_env(),
        cwd=REPO,
        **kwargs,
    )


def lockstep_popen(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "lockstep.cli.main", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env or cli_env(),
        cwd=REPO,
    )


def lockstep_in_process(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``lockstep ARGS`` in this process (``lockstep.cli.main.main``), with ``cli_env()``'s environment
    for the duration, and capture its output and exit code like :func:`lockstep`.

    For commands that start no process and leave no global state behind (``estimate-memory``, ``config``,
    ``report``, a ``launch`` refused before it starts): a subprocess would spend seconds importing torch
    (and transformers) again for each call. A test of the command as users run it keeps one real
    subprocess call.
    """
    import contextlib
    import io

    from lockstep.cli.main import main

    saved, cwd = dict(os.environ), os.getcwd()
    stdout, stderr = io.StringIO(), io.StringIO()
    os.environ.clear()
    os.environ.update(env or cli_env())
    os.chdir(REPO)
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                code = main(list(args))
            except SystemExit as stop:  # argparse's errors and --help
                code = stop.code if isinstance(stop.code, int) else 1
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(saved)
    return subprocess.CompletedProcess(["lockstep", *args], code, stdout.getvalue(), stderr.getvalue())
