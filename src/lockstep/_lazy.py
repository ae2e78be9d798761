"""Names a package exports without importing their modules until first used (PEP 562).

The ``backends`` packages export their classes this way, so that the launcher can read a backend's spec
(``lockstep.backends.<name>.spec``) without importing torch.

Example:
    >>> getattr_, names = lazy_exports("pkg", {"OrderedDict": "collections"})
    >>> names, getattr_("OrderedDict").__name__
    (['OrderedDict'], 'OrderedDict')
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], list[str]]:
    """A module ``__getattr__`` that imports each name of ``exports`` (name -> module) on first use, and the
    sorted ``__all__``."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__, sorted(exports)
