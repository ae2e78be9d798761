"""``TrainingArguments`` on the command line: one ``--field`` option per dataclass field.

Booleans take ``--bf16`` or ``--bf16 true|false``; list fields take several values or one comma-separated
value; dict fields take JSON text or the path of a JSON file. Abbreviations are refused so that a
script's own ``--data`` is never mistaken for ``--data_seed``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from collections.abc import Sequence
from typing import Any

_SUPPRESS = argparse.SUPPRESS


def _to_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes", "y", "on"):
        return True
    if lowered in ("false", "0", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _bool_or_text(text: str) -> bool | str:
    try:
        return _to_bool(text)
    except argparse.ArgumentTypeError:
        return text


def _optional(kind: Any) -> Any:
    def convert(text: str) -> Any:
        return None if text.strip().lower() == "none" else kind(text)

    convert.__name__ = getattr(kind, "__name__", "value")
    return convert


def _number(text: str) -> float | int:
    value = float(text)
    return int(value) if value.is_integer() and "." not in text and "e" not in text.lower() else value


def _option_kwargs(hint: Any) -> dict[str, Any]:
    """argparse keyword arguments for one field's type hint."""
    args = set(typing.get_args(hint)) or {hint}
    optional = type(None) in args
    args.discard(type(None))
    if bool in args and str in args:  # a choice that also takes true/false (include_num_input_tokens_seen)
        return {"type": _bool_or_text, "nargs": "?", "const": True}
    if bool in args:
        return {"type": _optional(_to_bool) if optional else _to_bool, "nargs": "?", "const": True}
    if any(typing.get_origin(a) is list for a in args):
        return {"nargs": "+", "type": str}
    if dict in args:
        return {"type": str, "metavar": "JSON_OR_PATH"}
    if args == {float} or args == {int, float}:
        return {"type": _optional(_number) if optional else _number}
    kind = next(iter(args))
    if kind in (int, float, str):
        return {"type": _optional(kind) if optional else kind}
    return {"type": str}


def add_fields(cls: type, parser: argparse.ArgumentParser, defaults: dict[str, Any]) -> None:
    """Add an option per field of ``cls``; unset options stay absent so dataclass defaults apply."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(defaults) - names)
    if unknown:
        raise ValueError(f"defaults names unknown TrainingArguments field(s) {unknown}.")
    group = parser.add_argument_group("training arguments (lockstep.TrainingArguments)")
    for f in dataclasses.fields(cls):
        default = defaults.get(f.name, f.default if f.default is not dataclasses.MISSING else None)
        help_text = f"{f.metadata.get('help', '')} (default: {default!r})".replace("%", "%%")
        group.add_argument(
            f"--{f.name}", dest=f.name, default=_SUPPRESS, help=help_text, **_option_kwargs(hints[f.name])
        )


def parse(
    cls: type,
    argv: Sequence[str] | None,
    defaults: dict[str, Any],
    *,
    parser: argparse.ArgumentParser | None,
    allow_unknown: bool,
) -> tuple[Any, Any]:
    """Parse ``argv``; returns (arguments, unknown options) or (arguments, the user's own namespace)."""
    own = parser is not None
    if parser is None:
        parser = argparse.ArgumentParser(description="lockstep Trainer arguments", allow_abbrev=False)
    else:
        parser.allow_abbrev = False
    own_dests = {action.dest for action in parser._actions} - {"help"}
    add_fields(cls, parser, defaults)
    argv = list(sys.argv[1:] if argv is None else argv)
    if allow_unknown:
        namespace, rest = parser.parse_known_args(argv)
    else:
        namespace, rest = parser.parse_args(argv), []
    values = dict(defaults)
    values.update({name: value for name, value in vars(namespace).items() if name not in own_dests})
    try:
        arguments = cls(**values)
    except (ValueError, TypeError, NotImplementedError) as error:
        parser.error(str(error))
    if own:
        return arguments, argparse.Namespace(**{k: v for k, v in vars(namespace).items() if k in own_dests})
    return arguments, rest
