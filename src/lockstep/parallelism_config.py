"""``accelerate.parallelism_config``: ``ParallelismConfig``, the N-D layout of the processes.

The class lives in :mod:`lockstep.config.parallelism`; it is the same object as ``lockstep.ParallelismConfig``
and ``lockstep.utils.ParallelismConfig``.

Example:
    >>> ParallelismConfig(dp_shard_size=2, tp_size=2).active_mesh_dims
    ['dp_shard', 'tp']
"""

from __future__ import annotations

from lockstep.config.parallelism import ParallelismConfig

__all__ = ["ParallelismConfig"]
