"""Values of ``TrainingArguments`` fields given as text: JSON dicts (inline or a file's path) and name lists.

Shared by the Trainer's own fields and by the fields a backend declares in its folder (the ``fsdp`` options, the
``deepspeed`` config: :attr:`lockstep.config.vocabulary.Vocabulary.trainer_normalize`), so it lives below both.
This module must not import torch.

Example:
    >>> name_list("full_shard, offload", argument="fsdp")
    ['full_shard', 'offload']
    >>> load_json_dict('{"zero_optimization": {"stage": 2}}', argument="deepspeed")
    {'zero_optimization': {'stage': 2}}
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def load_json_dict(value: Any, *, argument: str) -> dict[str, Any] | None:
    """A dict given as a dict, as JSON text, or as the path of a JSON file (None stays None).

    Raises:
        ValueError: for a missing file, invalid JSON, or JSON that is not an object.
        TypeError: for any other kind of value.
    """
    if value is None:
        return None
    if isinstance(value, dict):
        return dict(value)
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(
            f"TrainingArguments({argument}={value!r}) is invalid: pass a dict, JSON text or the path of a JSON file."
        )
    text = os.fspath(value).strip()
    if not text:
        return None
    if text.startswith("{"):
        source, raw = "the JSON text", text
    else:
        path = Path(text)
        if not path.is_file():
            raise ValueError(
                f"TrainingArguments({argument}={text!r}) is invalid: no such file. Pass the path of a JSON file, "
                "JSON text such as '{\"key\": 1}', or a dict."
            )
        source, raw = str(path), path.read_text(encoding="utf-8")
    try:
        loaded = json.loads(raw)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"TrainingArguments({argument}=...): {source} is not valid JSON ({error})."
        ) from None
    if not isinstance(loaded, dict):
        raise ValueError(
            f"TrainingArguments({argument}=...): {source} holds a JSON {type(loaded).__name__}; it must hold an "
            "object ({...})."
        )
    return loaded


def name_list(value: Any, *, argument: str) -> list[str]:
    """``"a,b"``, ``"a b"``, ``["a", "b"]`` or None as a list of names."""
    if value is None:
        return []
    if isinstance(value, str):
        return [part for part in value.replace(",", " ").split() if part]
    if isinstance(value, Sequence) and all(isinstance(v, str) for v in value):
        return [part for v in value for part in name_list(v, argument=argument)]
    raise TypeError(
        f"TrainingArguments({argument}={value!r}) is invalid: pass a string or a list of strings."
    )
