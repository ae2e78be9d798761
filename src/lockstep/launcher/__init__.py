"""Starting workers: ``lockstep launch`` (scripts) and the notebook/debug launchers (functions).

Names load on first use: every worker imports ``lockstep.launcher._worker``, which must stay light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["debug_launcher", "notebook_launcher"]

if TYPE_CHECKING:
    from lockstep.launcher.notebook import debug_launcher, notebook_launcher


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'lockstep.launcher' has no attribute {name!r}")
    value = getattr(importlib.import_module("lockstep.launcher.notebook"), name)
    globals()[name] = value
    return value
