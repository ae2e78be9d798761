"""The command line starts without importing torch (it is imported only by the commands that run it)."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers.cli import cli_env

PROBE = """
import sys
from lockstep.cli.main import build_parser
build_parser()
for name in ("launch", "config", "env", "merge-weights", "estimate-memory", "report", "test"):
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
