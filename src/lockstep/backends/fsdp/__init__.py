"""Fully sharded data parallel training on torch's FSDP2 (``fully_shard``).

The backend class loads on first use (``lockstep.backends.fsdp.backend``): the package itself stays torch-free,
so that its ``spec`` (the backend's vocabulary) can be read by the launcher.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FSDPBackend"]


def __getattr__(name: str) -> Any:
    if name == "FSDPBackend":
        from lockstep.backends.fsdp.backend import FSDPBackend

        return FSDPBackend
    raise AttributeError(f"module 'lockstep.backends.fsdp' has no attribute {name!r}")
