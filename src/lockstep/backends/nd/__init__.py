"""N-D parallelism on a device mesh: tensor and context parallelism, FSDP2 and HSDP composed (``ParallelismConfig``).

The backend class loads on first use (``lockstep.backends.nd.backend``): the package itself stays torch-free,
so that its ``spec`` (the backend's vocabulary) can be read by the launcher.
"""

from __future__ import annotations

from typing import Any

__all__ = ["NDParallelBackend"]


def __getattr__(name: str) -> Any:
    if name == "NDParallelBackend":
        from lockstep.backends.nd.backend import NDParallelBackend

        return NDParallelBackend
    raise AttributeError(f"module 'lockstep.backends.nd' has no attribute {name!r}")
