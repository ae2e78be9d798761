"""``lockstep test``: launch the configured topology for real and run built-in checks."""

from __future__ import annotations

import argparse
from typing import Any

from lockstep.cli.launch_cmd import add_launch_flags, load_settings


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "test", help="check the set-up: launch the configured topology and run checks"
    )
    add_launch_flags(parser)
    parser.set_defaults(handler=run_test, module=False)


def run_test(args: argparse.Namespace) -> int:
    from lockstep.launcher.elastic import launch

    settings = load_settings(args)
    print(
        f"lockstep test: launching {settings.processes_per_machine} process(es) on machine {settings.machine_rank} "
        f"of {settings.num_machines} ({settings.distributed_type})"
    )
    code = launch(
        settings,
        "lockstep.cli.selftest_worker",
        ["--expected-processes", str(settings.world_size)],
        module=True,
    )
    print("lockstep test: all checks passed" if code == 0 else f"lockstep test: FAILED (exit code {code})")
    return code
