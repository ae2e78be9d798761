"""Every script under bench/ and bench/peers/ imports as its runner imports it, builds its ``--help``, and
imports only names that exist (tests/bench/_check_bench_imports.py), so that a renamed helper breaks CI
instead of the next benchmark run. One interpreter for all of them: about 8 s of CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKER = Path(__file__).with_name("_check_bench_imports.py")
PEERS_PYTHON = ROOT / "bench" / "peers" / ".venv" / "bin" / "python"


def check(python: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [python, str(CHECKER), str(ROOT)], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def report() -> dict:
    return check(sys.executable)


def test_every_bench_script_imports_and_builds_its_help(report):
    scripts = {path.relative_to(ROOT).as_posix() for path in (ROOT / "bench").glob("**/*.py")}
    scripts = {s for s in scripts if "/.venv/" not in s}
    assert set(report) == scripts
    problems = {script: entry["problems"] for script, entry in report.items() if entry["problems"]}
    assert problems == {}
    # the entry points are checked through their parsers, not only imported
    with_main = {script for script, entry in report.items() if entry["help"]}
    assert {"bench/checkpoint_io.py", "bench/peers/run.py", "bench/peers/_step_worker.py"} <= with_main


def test_only_the_peers_packages_go_unchecked_here(report):
    """lockstep's environment has neither Accelerate nor Fabric; the names taken from them are checked by
    the next test, in the peers' environment."""
    unchecked = [line for entry in report.values() for line in entry["unchecked"]]
    packages = {line.split()[3].split(".")[0] for line in unchecked}
    assert packages <= {"accelerate", "lightning_fabric"}


@pytest.mark.skipif(
    not PEERS_PYTHON.exists(), reason="needs the peers' environment (bash bench/peers/setup.sh)"
)
def test_names_from_the_peers_packages_exist_in_the_peers_environment():
    report = check(str(PEERS_PYTHON))
    assert {s: e["problems"] for s, e in report.items() if e["problems"]} == {}
    assert [line for entry in report.values() for line in entry["unchecked"]] == []
