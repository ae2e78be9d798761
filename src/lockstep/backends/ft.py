"""Fault tolerance's former import path (``from lockstep.backends.ft import FaultToleranceConfig``).

Fault tolerance is a layer, not a backend: it lives in :mod:`lockstep.layers.fault_tolerance`, and this module
only re-exports that package's public names for code written against the old path.
"""

from lockstep.errors import ReplicaQuorumError
from lockstep.layers.fault_tolerance.config import FaultToleranceConfig
from lockstep.layers.fault_tolerance.layer import FaultTolerance

__all__ = ["FaultTolerance", "FaultToleranceConfig", "ReplicaQuorumError"]
