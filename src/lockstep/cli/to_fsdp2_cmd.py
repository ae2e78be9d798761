"""``lockstep to-fsdp2 --config-file FILE (--output-file OUT | --overwrite)``: convert an FSDP1 config.

As ``accelerate to-fsdp2`` does: the file's ``fsdp_config`` is converted from FSDP1 to FSDP2
(:func:`lockstep.backends.fsdp.to_fsdp2.convert_to_fsdp2`: the sharding strategy becomes
``fsdp_reshard_after_forward``, settings FSDP2 does not have are removed, ``fsdp_version`` becomes 2) and
the whole file is written to ``--output-file``, or over the input with ``--overwrite``. Every other key is
kept as written. Each change is printed on a line of its own; a missing or empty input, an output that
exists without ``--overwrite``, or a value that is no FSDP setting exit with code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from lockstep.cli._errors import UsageError

_DESCRIPTION = "Convert a config file's fsdp_config from FSDP1 to FSDP2 (as `accelerate to-fsdp2` does)."


def register(subparsers: Any) -> None:
    """Add ``to-fsdp2`` to the ``lockstep`` parser."""
    parser = subparsers.add_parser(
        "to-fsdp2", help="convert a config file from FSDP1 to FSDP2", description=_DESCRIPTION
    )
    parser.add_argument(
        "--config-file",
        "--config_file",
        dest="config_file",
        required=True,
        metavar="FILE",
        help="the file to convert",
    )
    parser.add_argument(
        "--output-file",
        "--output_file",
        dest="output_file",
        metavar="OUT",
        help="where to write the converted file (default with --overwrite: FILE itself)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="write over FILE, or over an OUT that exists"
    )
    parser.set_defaults(handler=run_to_fsdp2)


def _output(args: argparse.Namespace) -> Path:
    """Where to write, checked as Accelerate checks it."""
    if args.output_file is None:
        if not args.overwrite:
            raise UsageError("pass --output-file OUT, or --overwrite to convert the file in place.")
        return Path(args.config_file)
    output = Path(args.output_file)
    if output.exists() and not args.overwrite:
        raise UsageError(f"{output} already exists; pass --overwrite to replace it.")
    return output


def _read(path: Path) -> dict[str, Any]:
    import yaml

    if not path.is_file():
        raise UsageError(f"--config-file {str(path)!r} does not exist.")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise UsageError(f"{path}: cannot read it as YAML ({type(error).__name__}).") from None
    if not data:
        raise UsageError(f"{path} is empty: there is nothing to convert.")
    if not isinstance(data, dict):
        raise UsageError(f"{path} must hold a mapping of settings, got {type(data).__name__}.")
    return data


def run_to_fsdp2(args: argparse.Namespace) -> int:
    """Convert, report each change, write the result."""
    from lockstep.backends.fsdp.to_fsdp2 import convert_to_fsdp2
    from lockstep.config.file import write_settings

    source = Path(args.config_file)
    data = _read(source)
    output = _output(args)
    try:
        result = convert_to_fsdp2(data)
    except ValueError as error:
        raise UsageError(f"{source}: {str(error).rstrip('.')}; nothing was written.") from None
    for note in result.notes:
        print(f"lockstep to-fsdp2: {note}", file=sys.stderr)
    try:
        write_settings(result.config, output)
    except OSError as error:
        raise UsageError(f"cannot write {output}: {error.strerror or error}.") from None
    verb = "Converted" if result.converted else "Copied unchanged"
    print(f"{verb} {source} -> {output}")
    return 0
