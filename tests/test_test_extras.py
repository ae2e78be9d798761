"""A missing test dependency fails the suite loudly instead of shrinking it.

Tests of optional integrations skip when their package is absent (``tests.helpers.optional.requires``), so
an environment built without, say, deepspeed or transformers would stay green with a hundred tests fewer.
Here every package of the extras that ``dev/setup.sh`` installs (the ``test`` extra among them) must be
installed at a version the extra allows and import. And ``dev/setup.sh`` must stop when an install fails.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
SETUP = ROOT / "dev" / "setup.sh"

# Distribution name -> the module it is imported as (None: a command-line tool, checked by its metadata).
IMPORT_NAMES: dict[str, str | None] = {
    "pytest": "pytest",
    "hypothesis": "hypothesis",
    "ruff": None,
    "nbclient": "nbclient",
    "nbformat": "nbformat",
    "ipykernel": "ipykernel",
    "tensorboard": "tensorboard",
    "mlflow-skinny": "mlflow",
    "sqlalchemy": "sqlalchemy",
    "alembic": "alembic",
    "wandb": "wandb",
    "matplotlib": "matplotlib",
    "datasets": "datasets",
    "torchdata": "torchdata",
    "deepspeed": "deepspeed",
    "optuna": "optuna",
    "transformers": "transformers",
    "pytest-xdist": "xdist",
    "moto": "moto",
    "s3fs": "s3fs",
    "ray": "ray",
    "torchft": "torchft",
    "mpich": None,
    # the docs extra (tests/docs/ builds the site)
    "mkdocs": "mkdocs",
    "mkdocs-material": "material",
    "mkdocstrings": "mkdocstrings",
    "mkdocstrings-python": "mkdocstrings_handlers.python",
}


def _optional_dependencies() -> dict[str, list[str]]:
    text = (ROOT / "pyproject.toml").read_text()
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib.loads(text)["project"]["optional-dependencies"]
    pytest.skip("reading pyproject.toml needs tomllib (Python 3.11+)")


def _installed_groups() -> list[str]:
    """The extras dev/setup.sh installs lockstep with (``pip install -e ".[test,...]"``)."""
    found = re.search(r'-e "\.\[([a-z0-9_,-]+)\]"', SETUP.read_text())
    assert found, "dev/setup.sh no longer installs lockstep with extras: update this test"
    return found.group(1).split(",")


def _requirements() -> dict[str, Requirement]:
    extras = _optional_dependencies()
    groups = _installed_groups()
    assert "test" in groups
    requirements = [Requirement(line) for group in groups for line in extras[group]]
    return {requirement.name.lower(): requirement for requirement in requirements}


def test_every_package_of_the_installed_extras_is_mapped_to_its_module():
    unmapped = sorted(set(_requirements()) - set(IMPORT_NAMES))
    assert unmapped == [], f"add the import name of {unmapped} to IMPORT_NAMES"


def test_every_package_of_the_installed_extras_is_installed_at_an_allowed_version():
    problems = []
    for name, requirement in _requirements().items():
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            problems.append(f"{name} is not installed")
            continue
        if not requirement.specifier.contains(version, prereleases=True):
            problems.append(f"{name} {version} is installed; the extra asks for {requirement}")
    assert problems == [], "; ".join(problems) + ". Run dev/setup.sh (pip install -e '.[test]')."


_IMPORT_ALL = """
import importlib, json, sys, warnings
warnings.simplefilter("ignore")
failed = {}
for module in sys.argv[1:]:
    try:
        importlib.import_module(module)
    except Exception as error:  # every failure is reported, not only the first
        failed[module] = f"{type(error).__name__}: {error}"
print(json.dumps(failed))
"""


def test_every_package_of_the_installed_extras_imports():
    modules = sorted({IMPORT_NAMES[name] for name in _requirements() if IMPORT_NAMES.get(name)})
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL, *modules], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    failed = json.loads(done.stdout.strip().splitlines()[-1])
    assert failed == {}, f"these test dependencies do not import: {failed}"


# -- dev/setup.sh stops on a failed install ------------------------------------------------------------
FAKE_PYTHON = """#!/usr/bin/env bash
# Stands in for .venv/bin/python: records each call; `pip install` of the package named in FAIL_ON fails.
echo "$*" >> "$CALLS"
if [ "$1 $2 $3" = "-m pip install" ]; then
  echo "WARNING: Location noise"
  case "$*" in *"$FAIL_ON"*) echo "ERROR: No matching distribution found" >&2; exit 1;; esac
fi
exit 0
"""


def _run_setup(tmp_path: Path, fail_on: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "setup.sh").write_text(SETUP.read_text())
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    calls = tmp_path / "calls.txt"
    env = {**os.environ, "CALLS": str(calls), "FAIL_ON": fail_on}
    done = subprocess.run(
        ["bash", str(tmp_path / "dev" / "setup.sh")], capture_output=True, text=True, timeout=60, env=env
    )
    return done, calls.read_text().splitlines() if calls.exists() else []


def test_setup_stops_at_a_failed_install(tmp_path):
    done, calls = _run_setup(tmp_path, fail_on="-e .[")
    assert done.returncode == 1
    assert "ERROR: No matching distribution found" in done.stdout  # pip's stderr goes through the filter
    assert "dev/setup.sh: the command above failed (exit 1)" in done.stderr
    assert "WARNING: Location" not in done.stdout + done.stderr  # the noise is still filtered
    assert len(calls) == 2 and "torch==2.13.0" in calls[0]  # nothing ran after the failed install


def test_setup_runs_through_when_every_install_succeeds_quietly(tmp_path):
    done, calls = _run_setup(tmp_path, fail_on="no package fails")
    assert done.returncode == 0, done.stderr
    assert len(calls) == 4 and calls[-1].startswith("-c import torch, lockstep")
