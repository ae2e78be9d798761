"""N-D parallelism on a device mesh: tensor and context parallelism, FSDP2 and HSDP composed (``ParallelismConfig``).

The backend class loads on first use (``lockstep.backends.nd.backend``): the package itself stays torch-free,
so that its ``spec`` (the backend's vocabulary) can be read by the launcher.
"""

from lockstep._lazy import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "NDParallelBackend": "lockstep.backends.nd.backend",
    },
)
