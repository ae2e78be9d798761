"""Griffe extension: lockstep's docstrings title their doctests ``Example:``, which Google style reads as an
admonition of Markdown text; as ``Examples:`` they render as code (and ``[4, 5]`` is not read as a link)."""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
