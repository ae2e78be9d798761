"""lockstep: one PyTorch training loop on one CPU, one GPU, many processes and many machines.

Public names are loaded on first use, so that ``import lockstep`` (and the ``lockstep`` command) does not
pay for torch until something needs it.

Example:
    >>> from lockstep import Accelerator
    >>> accelerator = Accelerator()
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Accelerator": "lockstep.accelerator",
    "AcceleratorState": "lockstep.state",
    "GradientState": "lockstep.state",
    "PartialState": "lockstep.state",
    "AutocastKwargs": "lockstep.config",
    "DDPCommunicationHookType": "lockstep.config",
    "DataLoaderConfiguration": "lockstep.config",
    "DistributedDataParallelKwargs": "lockstep.config",
    "DistributedType": "lockstep.config",
    "DynamoBackend": "lockstep.config",
    "FullyShardedDataParallelPlugin": "lockstep.config",
    "GradScalerKwargs": "lockstep.config",
    "GradientAccumulationPlugin": "lockstep.config",
    "HangDetectionKwargs": "lockstep.diagnostics",
    "InitProcessGroupKwargs": "lockstep.config",
    "LoggerType": "lockstep.config",
    "PrecisionType": "lockstep.config",
    "ProjectConfiguration": "lockstep.config",
    "RNGType": "lockstep.config",
    "TorchDynamoPlugin": "lockstep.config",
    "ThroughputKwargs": "lockstep.throughput",
    "skip_first_batches": "lockstep.data",
    "debug_launcher": "lockstep.launcher",
    "notebook_launcher": "lockstep.launcher",
    "progress_bar": "lockstep.progress",
    "find_executable_batch_size": "lockstep.memory",
    "release_memory": "lockstep.memory",
    "set_seed": "lockstep.rng",
    "EvalPrediction": "lockstep.trainer",
    "Trainer": "lockstep.trainer",
    "TrainerCallback": "lockstep.trainer",
    "TrainerControl": "lockstep.trainer",
    "TrainerState": "lockstep.trainer",
    "TrainingArguments": "lockstep.trainer",
}

__all__ = [
    "Accelerator",
    "AcceleratorState",
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "DynamoBackend",
    "EvalPrediction",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "GradientState",
    "HangDetectionKwargs",
    "InitProcessGroupKwargs",
    "LoggerType",
    "PartialState",
    "PrecisionType",
    "ProjectConfiguration",
    "RNGType",
    "ThroughputKwargs",
    "TorchDynamoPlugin",
    "Trainer",
    "TrainerCallback",
    "TrainerControl",
    "TrainerState",
    "TrainingArguments",
    "__version__",
    "debug_launcher",
    "find_executable_batch_size",
    "notebook_launcher",
    "progress_bar",
    "release_memory",
    "set_seed",
    "skip_first_batches",
]

if TYPE_CHECKING:
    from lockstep.accelerator import Accelerator
    from lockstep.config import (
        AutocastKwargs,
        DataLoaderConfiguration,
        DDPCommunicationHookType,
        DistributedDataParallelKwargs,
        DistributedType,
        DynamoBackend,
        FullyShardedDataParallelPlugin,
        GradientAccumulationPlugin,
        GradScalerKwargs,
        InitProcessGroupKwargs,
        LoggerType,
        PrecisionType,
        ProjectConfiguration,
        RNGType,
        TorchDynamoPlugin,
    )
    from lockstep.data import skip_first_batches
    from lockstep.diagnostics import HangDetectionKwargs
    from lockstep.launcher import debug_launcher, notebook_launcher
    from lockstep.memory import find_executable_batch_size, release_memory
    from lockstep.progress import progress_bar
    from lockstep.rng import set_seed
    from lockstep.state import AcceleratorState, GradientState, PartialState
    from lockstep.throughput import ThroughputKwargs
    from lockstep.trainer import (
        EvalPrediction,
        Trainer,
        TrainerCallback,
        TrainerControl,
        TrainerState,
        TrainingArguments,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lockstep' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
