"""Settings as dataclasses: every knob of lockstep, validated where it is created."""

from lockstep.config.dataloader import DataLoaderConfiguration
from lockstep.config.enums import (
    DDPCommunicationHookType,
    DistributedType,
    DynamoBackend,
    LoggerType,
    PrecisionType,
    RNGType,
)
from lockstep.config.kwargs import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
)
from lockstep.config.plugins import GradientAccumulationPlugin, TorchDynamoPlugin
from lockstep.config.project import ProjectConfiguration

__all__ = [
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "DynamoBackend",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "LoggerType",
    "PrecisionType",
    "ProjectConfiguration",
    "RNGType",
    "TorchDynamoPlugin",
]
