"""The reference environment: the real Accelerate and transformers, apart from lockstep's environment.

``dev/reference_env.sh`` (run by ``make test``) builds ``.venv-reference`` from
``dev/reference-requirements.txt``. Tests reach it in two ways:

- :func:`run_reference` runs a Python snippet with the reference interpreter (``accelerate launch``-free:
  one process, or several through ``torch.distributed.run``), so Accelerate itself writes and reads files;
- :func:`accelerate_pythonpath` is a folder holding the accelerate package alone, for tests that run
  lockstep's own environment with accelerate importable (transformers needs it for ``tp_plan`` and to write
  Trainer checkpoints). ``LOCKSTEP_REFERENCE_PYTHONPATH`` overrides it;
- :func:`peft_pythonpath` adds the folder holding the peft package alone (peft imports accelerate; its other
  dependencies are lockstep's own), for the LoRA tests. ``LOCKSTEP_PEFT_PYTHONPATH`` overrides it.

Without the environment the tests skip, except under CI (``CI=true``), where they fail: a reference test that
silently skips in CI checks nothing.
"""

from __future__ import annotations

import os
import subprocess
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.helpers.close_group_at_exit import RUNNER
from tests.helpers.deadlines import scaled

REPO = Path(__file__).resolve().parents[2]
REFERENCE_VENV = REPO / ".venv-reference"
REFERENCE_PYTHON = REFERENCE_VENV / "bin" / "python"
ACCELERATE_ONLY = REFERENCE_VENV / "accelerate-only"
PEFT_ONLY = REFERENCE_VENV / "peft-only"
BUILD = "bash dev/reference_env.sh (make test runs it)"


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def _missing(what: str) -> None:
    message = f"the reference environment is missing: {what}. Build it with {BUILD}"
    if in_ci():
        pytest.fail(f"CI=true: {message}", pytrace=False)
    pytest.skip(message)


def reference_python() -> Path:
    """The reference interpreter; skips the test (fails it under CI) when it is not built."""
    if not REFERENCE_PYTHON.is_file():
        _missing(f"{REFERENCE_PYTHON} does not exist")
    return REFERENCE_PYTHON


def accelerate_pythonpath() -> str:
    """A folder holding accelerate alone (``LOCKSTEP_REFERENCE_PYTHONPATH`` if set, else the one in the
    reference environment); skips the test (fails it under CI) when there is none."""
    override = os.environ.get("LOCKSTEP_REFERENCE_PYTHONPATH", "")
    if override:
        return override
    if not (ACCELERATE_ONLY / "accelerate" / "__init__.py").is_file():
        _missing(f"{ACCELERATE_ONLY} holds no accelerate package")
    return str(ACCELERATE_ONLY)


def peft_pythonpath() -> list[str]:
    """The folders to put first on the path for ``import peft`` in lockstep's environment: the one holding peft
    alone (``LOCKSTEP_PEFT_PYTHONPATH`` if set, else the reference environment's), then accelerate's (peft
    imports it). Skips the test (fails it under CI) when either is missing."""
    folder = os.environ.get("LOCKSTEP_PEFT_PYTHONPATH", "") or str(PEFT_ONLY)
    if not (Path(folder) / "peft" / "__init__.py").is_file():
        _missing(f"{folder} holds no peft package")
    return [folder, accelerate_pythonpath()]


def bitsandbytes_pythonpath() -> str:
    """The folder holding bitsandbytes alone (``dev/reference-qlora.txt``), for the QLoRA tests, to put on the
    path beside :func:`peft_pythonpath`'s. Skips the test (fails it under CI) when it is not built."""
    folder = REFERENCE_VENV / "bitsandbytes-only"
    if not (folder / "bitsandbytes" / "__init__.py").is_file():
        _missing(f"{folder} holds no bitsandbytes package")
    return str(folder)


def transformers_overlay(version: str) -> str:
    """The folder holding transformers ``version`` (4.40.2 or 4.56.2) with its tokenizers and huggingface_hub,
    to put first on ``PYTHONPATH`` with either environment's python; skips the test (fails it under CI) when it
    is not built."""
    folder = REFERENCE_VENV / f"transformers-{version}"
    if not (folder / "transformers" / "__init__.py").is_file():
        _missing(f"{folder} holds no transformers package")
    return str(folder)


def examples_overlay() -> str:
    """The folder holding ``datasets`` and ``evaluate`` in versions that import with the transformers 4.x
    overlays' ``huggingface_hub`` (``dev/reference-examples.txt``), for transformers' example scripts; put
    after the overlay on ``PYTHONPATH`` with lockstep's python (whose pyarrow, pandas and dill they use).
    Skips the test (fails it under CI) when it is not built."""
    folder = REFERENCE_VENV / "examples"
    if not (folder / "evaluate" / "__init__.py").is_file():
        _missing(f"{folder} holds no evaluate package")
    return str(folder)


def reference_env(**extra: str) -> dict[str, str]:
    """Environment variables for a reference process: CPU only, one thread, the repository importable (for
    ``tests.helpers``; lockstep's ``src`` is left off so that nothing there shadows the real libraries)."""
    env = {
        key: value for key, value in os.environ.items() if not key.startswith(("LOCKSTEP_", "ACCELERATE_"))
    }
    env.update(
        PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", **extra
    )
    return env


def run_reference(
    snippet: str, *args: str, folder: Path, processes: int = 1, timeout: float = 120
) -> subprocess.CompletedProcess:
    """Write ``snippet`` (dedented) to ``folder`` and run it there with the reference interpreter and
    ``args`` as ``sys.argv[1:]``; with ``processes > 1`` through ``torch.distributed.run`` (gloo, loopback),
    the snippet run through ``close_group_at_exit`` (a clean exit from the process group). Fails the test with the output's tail when
    it exits non-zero."""
    python = str(reference_python())
    script = folder / "reference_snippet.py"
    script.write_text(textwrap.dedent(snippet), encoding="utf-8")
    command = [python, str(script), *args]
    if processes > 1:  # the group outlives Accelerate's snippet: the runner closes it (gloo abort at exit)
        command[1:1] = [
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={processes}",
            RUNNER,
        ]
    done = subprocess.run(
        command, env=reference_env(), capture_output=True, text=True, timeout=scaled(timeout), cwd=folder
    )
    if done.returncode != 0:
        pytest.fail(
            f"reference run exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}",
            pytrace=False,
        )
    return done


TRANSFORMERS_4 = ("4.40.2", "4.56.2")
"""The transformers 4.x versions of the reference environment's overlays (``transformers_overlay``)."""


def run_with_transformers(
    module: str, version: str, *args: str, first: Sequence[str] = (), timeout: float = 300
) -> subprocess.CompletedProcess:
    """Run ``python -m module args`` with transformers ``version`` (an overlay) first on the path, then the
    ``first`` folders, as :func:`run_module` does; skips (fails under CI) when the overlay is not built."""
    return run_module(module, *args, first=[transformers_overlay(version), *first], timeout=timeout)


def run_module(
    module: str, *args: str, first: Sequence[str] = (), timeout: float = 300
) -> subprocess.CompletedProcess:
    """Run ``python -m module args`` with lockstep's interpreter (one thread, no GPU, offline), the ``first``
    folders, then lockstep's sources and the repository on the path; fails the test with the output's tail
    when it exits non-zero."""
    import sys

    paths = [*first, str(REPO / "src"), str(REPO)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(paths),
        "CUDA_VISIBLE_DEVICES": "",
        "HF_HUB_OFFLINE": "1",
    }
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(timeout),
        cwd=REPO,
    )
    if done.returncode != 0:
        pytest.fail(
            f"{module} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}", pytrace=False
        )
    return done
