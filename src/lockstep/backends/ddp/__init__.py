"""Data parallel training with torch's DistributedDataParallel.

The backend class loads on first use (``lockstep.backends.ddp.backend``): the package itself stays torch-free,
so that its ``spec`` (the backend's vocabulary) can be read by the launcher.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DDPBackend"]


def __getattr__(name: str) -> Any:
    if name == "DDPBackend":
        from lockstep.backends.ddp.backend import DDPBackend

        return DDPBackend
    raise AttributeError(f"module 'lockstep.backends.ddp' has no attribute {name!r}")
