"""``accelerate.utils.deepspeed``: importable, not supported (lockstep has no DeepSpeed backend yet).

Constructing any of these classes or calling the functions raises ``NotImplementedError``. To shard a
model's parameters, gradients and optimizer state, use ``FullyShardedDataParallelPlugin`` (FSDP2).
"""

from lockstep.utils._unsupported import (
    DeepSpeedEngineWrapper,
    DeepSpeedOptimizerWrapper,
    DeepSpeedSchedulerWrapper,
    DummyOptim,
    DummyScheduler,
    HfDeepSpeedConfig,
    get_active_deepspeed_plugin,
    map_pytorch_optim_to_deepspeed,
)

__all__ = [
    "DeepSpeedEngineWrapper",
    "DeepSpeedOptimizerWrapper",
    "DeepSpeedSchedulerWrapper",
    "DummyOptim",
    "DummyScheduler",
    "HfDeepSpeedConfig",
    "get_active_deepspeed_plugin",
    "map_pytorch_optim_to_deepspeed",
]
