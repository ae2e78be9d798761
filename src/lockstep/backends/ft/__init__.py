"""Live fault tolerance across replica groups on torchft: a group that dies leaves the others stepping.

The package stays torch-free (the launcher reads its ``spec``); the backend loads on first use.
"""

from lockstep._lazy import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "FaultToleranceConfig": "lockstep.backends.ft.config",
        "FaultTolerantBackend": "lockstep.backends.ft.backend",
        "ReplicaQuorumError": "lockstep.errors",
    },
)
