"""``lockstep to-fsdp2``, ``lockstep config update`` and the launch flag tables start without torch."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers.cli import cli_env

PROBE = """
import sys
from lockstep.cli.main import build_parser
for argv in (["to-fsdp2", "--help"], ["config", "update", "--help"], ["launch", "--help"]):
    try:
        build_parser().parse_args(argv)
    except SystemExit:
        pass
import lockstep.cli.launch_flags, lockstep.backends.fsdp.to_fsdp2, lockstep.cli._unsupported_flags
print("torch" in sys.modules)
"""


def test_the_new_commands_and_flag_tables_do_not_import_torch():
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=cli_env(), timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "usage: lockstep to-fsdp2" in result.stdout and "usage: lockstep config update" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "False"
