"""``accelerate.parallelism_config``: the name ``ParallelismConfig``, whose feature is not built yet.

Accelerate's ``ParallelismConfig`` lays the processes out on a device mesh of several dimensions
(replicated and sharded data parallelism, tensor, context and sequence parallelism). lockstep distributes
over one dimension (DDP, or FSDP2 over all processes), so constructing one raises ``NotImplementedError``,
as passing ``Accelerator(parallelism_config=...)`` does. The same class is ``lockstep.utils.ParallelismConfig``.

Example:
    >>> ParallelismConfig(tp_size=2)
    Traceback (most recent call last):
    NotImplementedError: ParallelismConfig is not supported by lockstep: multi-dimensional parallelism (dp_replicate, dp_shard, tp, cp and sp mesh dimensions) is not built yet. Shard the model over all processes with FullyShardedDataParallelPlugin (FSDP2), or replicate it with DDP.
"""

from __future__ import annotations

from lockstep.utils._unsupported import ParallelismConfig

__all__ = ["ParallelismConfig"]
