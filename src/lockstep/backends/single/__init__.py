"""One process: nothing to wrap or synchronise.

The backend class loads on first use (``lockstep.backends.single.backend``): the package itself stays torch-free,
so that its ``spec`` (the backend's vocabulary) can be read by the launcher.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SingleProcessBackend"]


def __getattr__(name: str) -> Any:
    if name == "SingleProcessBackend":
        from lockstep.backends.single.backend import SingleProcessBackend

        return SingleProcessBackend
    raise AttributeError(f"module 'lockstep.backends.single' has no attribute {name!r}")
