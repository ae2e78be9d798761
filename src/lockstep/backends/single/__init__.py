"""One process: nothing to wrap or synchronise.

The backend class loads on first use (``lockstep.backends.single.backend``): the package itself stays torch-free,
so that its ``spec`` (the backend's vocabulary) can be read by the launcher.
"""

from lockstep._lazy import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "SingleProcessBackend": "lockstep.backends.single.backend",
    },
)
