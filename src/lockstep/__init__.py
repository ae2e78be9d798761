"""lockstep: one PyTorch training loop on one CPU, one GPU, many processes and many machines.

Example:
    >>> from lockstep import Accelerator
    >>> accelerator = Accelerator()
"""

from lockstep.accelerator import Accelerator
from lockstep.config import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    DistributedType,
    DynamoBackend,
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
from lockstep.memory import find_executable_batch_size, release_memory
from lockstep.random import set_seed
from lockstep.state import AcceleratorState, GradientState, PartialState

__version__ = "0.1.0"

__all__ = [
    "Accelerator",
    "AcceleratorState",
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "DynamoBackend",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "GradientState",
    "InitProcessGroupKwargs",
    "LoggerType",
    "PartialState",
    "PrecisionType",
    "ProjectConfiguration",
    "RNGType",
    "TorchDynamoPlugin",
    "__version__",
    "find_executable_batch_size",
    "release_memory",
    "set_seed",
    "skip_first_batches",
]
