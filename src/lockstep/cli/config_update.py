"""``lockstep config update [--config-file FILE]``: rewrite a config file in the current schema.

As ``accelerate config update`` does: the file is loaded with every default filled in, then written back
(YAML, or JSON for a ``.json`` file). What the rewrite changes is listed: defaults added, older Accelerate
spellings turned into today's (``fp16: true`` -> ``mixed_precision: fp16``, a top-level ``dynamo_backend``
-> ``dynamo_config``), and the keys lockstep ignores (TPU pods, SageMaker, IPEX) dropped with a warning. A
file that does not load is left untouched and the command exits with code 2.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from lockstep.cli._errors import UsageError, warnings_as_lines


def register_update(actions: Any) -> None:
    """Add the ``update`` action to ``lockstep config``."""
    parser = actions.add_parser(
        "update", help="rewrite a config file in the current schema, defaults filled in"
    )
    parser.add_argument(
        "--config-file",
        "--config_file",
        dest="config_file",
        default=argparse.SUPPRESS,
        metavar="PATH",
        help="the file to update (default: $LOCKSTEP_HOME/default_config.yaml)",
    )
    parser.set_defaults(handler=run_update)


def _file_keys(path: Path) -> set[str]:
    """The top-level keys as written (for the list of what changed)."""
    import yaml

    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    return set(data) if isinstance(data, dict) else set()


def run_update(args: argparse.Namespace) -> int:
    """Load the file with defaults filled in and write it back; exit 2 if it does not load."""
    from lockstep.config.file import ConfigFileError, default_config_path, load_config_file, save_config_file

    given = getattr(args, "config_file", None)
    path = Path(given) if given else default_config_path()
    if not path.is_file():
        hint = "check the path" if given else "pass --config-file, or run `lockstep config` to write one"
        raise UsageError(f"no config file at {path}: {hint}.")
    try:
        with warnings_as_lines("config update"):
            config = load_config_file(path)
        before = _file_keys(path)
    except ConfigFileError as error:
        raise UsageError(f"{str(error).rstrip('.')}; nothing was written.") from None
    try:
        save_config_file(config, path)
    except OSError as error:
        raise UsageError(f"cannot write {path}: {error.strerror or error}.") from None
    after = set(config.to_dict())
    print(f"Updated {path}: {config.summary()}")
    if after - before:
        print(f"  added (defaults): {', '.join(sorted(after - before))}")
    if before - after:
        print(f"  removed (renamed, ignored or unset): {', '.join(sorted(before - after))}")
    return 0
