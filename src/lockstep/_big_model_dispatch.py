"""Accelerate's big-model inference entry points: dispatching a model over devices with a device map, and
offloading it to CPU memory or disk with hooks. lockstep does not move weights with hooks, so these names
import (``from lockstep import dispatch_model`` where code wrote ``from accelerate import ...``) and
calling them raises ``NotImplementedError`` with what to use instead. (The stand-ins live in
:mod:`lockstep.utils._unsupported`, so that ``lockstep.utils`` re-exports ``infer_auto_device_map`` too.)

Example:
    >>> cpu_offload(object())
    Traceback (most recent call last):
    NotImplementedError: cpu_offload is not supported by lockstep: lockstep does not dispatch a model over devices or offload its weights with hooks (big-model inference). Load the model on one device (lockstep.big_modeling.init_empty_weights and lockstep.utils.load_checkpoint_in_model build and fill it without a copy), or shard it across processes with FullyShardedDataParallelPlugin (cpu_offload=True keeps the shards in CPU memory).
"""

from __future__ import annotations

from lockstep.utils.modeling import (
    cpu_offload,
    cpu_offload_with_hook,
    disk_offload,
    dispatch_model,
    infer_auto_device_map,
    load_checkpoint_and_dispatch,
)

__all__ = [
    "cpu_offload",
    "cpu_offload_with_hook",
    "disk_offload",
    "dispatch_model",
    "infer_auto_device_map",
    "load_checkpoint_and_dispatch",
]
