"""``lockstep config explain [FILE] [launch flags]``: every resolved launch setting and where it came from."""

from __future__ import annotations

import argparse
from typing import Any

from lockstep.cli.launch_cmd import add_launch_flags, load_settings


def register_explain(actions: Any) -> None:
    """Add the ``explain`` action to ``lockstep config``."""
    parser = actions.add_parser("explain", help="print every resolved launch setting and where it came from")
    parser.add_argument(
        "file", nargs="?", metavar="FILE", help="config file (default: the default file, if any)"
    )
    add_launch_flags(parser)
    parser.set_defaults(handler=run_explain)


def run_explain(args: argparse.Namespace) -> int:
    file = getattr(args, "file", None)
    if file is not None:
        args.config_file = file
    for name in ("file", "config_action"):
        if hasattr(args, name):
            delattr(args, name)
    settings = load_settings(args)
    print(f"config file: {settings.config_file or 'none'}")
    rows = [(name, str(value), source) for name, value, source in settings.explain()]
    width = max(len(name) for name, _, _ in rows)
    value_width = max(len(value) for _, value, _ in rows)
    for name, value, source in rows:
        print(f"  {name.ljust(width)}  {value.ljust(value_width)}  ({source})")
    return 0
