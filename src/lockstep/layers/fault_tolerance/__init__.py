"""Live fault tolerance across replica groups on torchft: a group that dies leaves the others stepping.

The package stays torch-free (the launcher reads its ``spec``); the layer loads on first use.
"""

from lockstep._lazy import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "FaultToleranceConfig": "lockstep.layers.fault_tolerance.config",
        "FaultTolerance": "lockstep.layers.fault_tolerance.layer",
        "ReplicaQuorumError": "lockstep.errors",
    },
)
