"""Starting workers: ``lockstep launch`` (scripts) and the notebook/debug launchers (functions).

Names load on first use: every worker imports ``lockstep.launcher._worker``, which must stay light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["WorkerFailedError", "debug_launcher", "notebook_launcher"]
_MODULES = {
    "WorkerFailedError": "lockstep.launcher.failures",
    "debug_launcher": "lockstep.launcher.notebook",
    "notebook_launcher": "lockstep.launcher.notebook",
}

if TYPE_CHECKING:
    from lockstep.launcher.failures import WorkerFailedError
    from lockstep.launcher.notebook import debug_launcher, notebook_launcher


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'lockstep.launcher' has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULES[name]), name)
    globals()[name] = value
    return value
