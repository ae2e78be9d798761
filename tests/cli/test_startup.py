"""The command line starts without importing torch (it is imported only by the commands that run it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cli import cli_env

PROBE = """
import sys
from lockstep.cli.main import build_parser
build_parser()
for name in ("launch", "config", "env", "merge-weights", "estimate-memory", "device-map", "report", "test"):
    try:
        build_parser().parse_args([name, "--help"])
    except SystemExit:
        pass
print("torch" in sys.modules)
"""


def test_building_the_parser_and_every_help_page_does_not_import_torch():
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=cli_env(), timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "False"


REFUSED_LAUNCH = """
import sys
from lockstep.cli.main import main
code = main(["launch", "--num-processes", "2", "--rdzv-backend", "etcd", "x.py"])
print(code, "torch" in sys.modules)
"""


def test_a_launch_refused_on_a_machine_without_a_gpu_driver_does_not_import_torch():
    """Counting GPUs for the default process count needs torch only where a GPU driver is loaded: a refused
    launch answers in a fraction of a second instead of the seconds torch takes to import."""
    from lockstep.launcher.settings import GPU_DRIVER_PATHS

    if any(Path(path).exists() for path in GPU_DRIVER_PATHS):
        pytest.skip(f"a GPU driver is loaded here ({', '.join(GPU_DRIVER_PATHS)}): torch counts the devices")
    result = subprocess.run(
        [sys.executable, "-c", REFUSED_LAUNCH], capture_output=True, text=True, env=cli_env(), timeout=120
    )
    assert "--rdzv-backend 'etcd' is invalid" in result.stderr
    assert result.stdout.split() == ["2", "False"]
