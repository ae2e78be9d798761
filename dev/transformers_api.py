"""Write transformers' public ``TrainingArguments`` and ``Trainer`` surface to ``tests/transformers_trainer_surface.json``.

Run it with an interpreter that has the real transformers (lockstep's own environment has it, or the
reference environment):

    .venv/bin/python dev/transformers_api.py

It lists, with each callable's signature as ``[name, kind, default repr]`` per parameter (``self`` included):

- ``training_arguments_members``: the public methods and properties of ``TrainingArguments`` (its fields are
  checked by ``tests/trainer/test_field_parity.py``);
- ``trainer_init``: the parameters of ``Trainer.__init__``;
- ``trainer_members``: the public methods, properties and class attributes of ``Trainer``;
- ``trainer_attributes``: the other public attributes its methods assign on ``self`` (``self.state = ...``).

``tests/trainer/test_transformers_surface.py`` checks lockstep against this file.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

OUTPUT = Path(__file__).resolve().parents[1] / "tests" / "transformers_trainer_surface.json"
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")


def default_repr(value: Any) -> str | None:
    if value is inspect.Parameter.empty:
        return None
    return _ADDRESS.sub("", repr(value))


def signature_of(value: Any) -> list[list[str | None]] | None:
    """``[name, kind, default repr]`` per parameter; None for a property or a plain value."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if not callable(value) or isinstance(value, property):
        return None
    try:
        signature = inspect.signature(value)
    except (TypeError, ValueError):
        return None
    return [[p.name, p.kind.name, default_repr(p.default)] for p in signature.parameters.values()]


def kind_of(value: Any) -> str:
    if isinstance(value, property) or type(value).__name__ == "cached_property":
        return "property"
    if isinstance(value, (staticmethod, classmethod)):
        return type(value).__name__
    if inspect.isfunction(value):
        return "method"
    return "attribute"


def members(cls: type) -> dict[str, dict[str, Any]]:
    """Public names of ``cls`` (its dataclass fields left out), with kind and signature."""
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    found = {}
    for name in sorted(dir(cls)):
        if name.startswith("_") or name in fields:
            continue
        value = inspect.getattr_static(cls, name)
        found[name] = {"kind": kind_of(value), "signature": signature_of(value)}
    return found


def assigned_attributes(cls: type) -> list[str]:
    """Public ``self.<name> = ...`` targets in the methods of ``cls`` that are not class members."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    names = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for target in targets:
            if (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
                and not target.attr.startswith("_")
            ):
                names.add(target.attr)
    return sorted(names - set(dir(cls)))


def main() -> None:
    import transformers
    from transformers import Trainer, TrainingArguments

    init = signature_of(Trainer.__init__)
    surface = {
        "generated_by": "python dev/transformers_api.py",
        "transformers_version": transformers.__version__,
        "python": sys.version.split()[0],
        "sections": {
            "training_arguments_members": members(TrainingArguments),
            "trainer_init": {name: {"kind": kind, "default": default} for name, kind, default in init[1:]},
            "trainer_members": members(Trainer),
            "trainer_attributes": {name: {"kind": "attribute"} for name in assigned_attributes(Trainer)},
        },
    }
    OUTPUT.write_text(json.dumps(surface, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    counts = {section: len(names) for section, names in surface["sections"].items()}
    print(f"wrote {OUTPUT} (transformers {transformers.__version__}): {counts}")


if __name__ == "__main__":
    main()
