"""Data parallel training with torch's DistributedDataParallel.

The backend class loads on first use (``lockstep.backends.ddp.backend``): the package itself stays torch-free,
so that its ``spec`` (the backend's vocabulary) can be read by the launcher.
"""

from lockstep._lazy import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "DDPBackend": "lockstep.backends.ddp.backend",
    },
)
