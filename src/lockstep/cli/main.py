"""``lockstep`` entry point: parse the subcommand and hand over to its module.

Subcommands register themselves through a ``register(subparsers)`` function in their own module; each
handler returns an exit code. Bad input raises :class:`~lockstep.cli._errors.UsageError`, which becomes one
line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from lockstep.cli._errors import EXIT_USAGE, UsageError

# Subcommand modules, imported lazily so that `lockstep --help` stays fast.
SUBCOMMANDS = (
    "config",
    "launch",
    "test",
    "env",
    "merge-weights",
    "estimate-memory",
    "device-map",
    "report",
    "to-fsdp2",
)

_MODULES = {
    "merge-weights": "merge",
    "estimate-memory": "estimate",
    "device-map": "device_map",
    "to-fsdp2": "to_fsdp2",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        print(f"Run '{self.prog} --help' for usage.", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="lockstep", description="Distributed PyTorch training: configure, check, launch.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    subparsers.required = True
    for name in SUBCOMMANDS:
        importlib.import_module(f"lockstep.cli.{_MODULES.get(name, name)}_cmd").register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except UsageError as error:
        print(f"lockstep {args.command}: error: {error}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
