"""Fully sharded data parallel training on torch's FSDP2 (``fully_shard``).

The backend class loads on first use (``lockstep.backends.fsdp.backend``): the package itself stays torch-free,
so that its ``spec`` (the backend's vocabulary) can be read by the launcher.
"""

from lockstep._lazy import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "FSDPBackend": "lockstep.backends.fsdp.backend",
    },
)
