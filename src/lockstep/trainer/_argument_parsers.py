"""Small parsers shared by TrainingArguments: choices here; JSON dicts given inline or as a file path and name
lists in :mod:`lockstep.config.argument_values` (the backends' fields use them too)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lockstep.config.argument_values import load_json_dict, name_list

__all__ = ["check_choice", "load_json_dict", "name_list"]


def check_choice(value: Any, choices: Sequence[str], *, argument: str) -> str:
    """``value`` lower-cased if it is one of ``choices``, else a ValueError listing them."""
    text = str(value).strip().lower() if isinstance(value, str) else value
    if text not in choices:
        raise ValueError(
            f"TrainingArguments({argument}={value!r}) is invalid: it must be one of "
            f"{', '.join(repr(c) for c in choices)}."
        )
    return text
