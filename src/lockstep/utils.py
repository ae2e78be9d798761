"""Compatibility namespace mirroring ``accelerate.utils``: the utility names, re-exported."""

from lockstep._nested import (
    concatenate,
    find_batch_size,
    honor_type,
    is_namedtuple,
    recursively_apply,
    send_to_device,
)
from lockstep.collectives import (
    CannotPadNestedTensorWarning,
    broadcast,
    broadcast_object_list,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
)
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
    KwargsHandler,
    LoggerType,
    PrecisionType,
    ProjectConfiguration,
    RNGType,
    TorchDynamoPlugin,
)
from lockstep.memory import find_executable_batch_size, release_memory
from lockstep.precision import convert_outputs_to_fp32
from lockstep.rng import set_seed, synchronize_rng_state, synchronize_rng_states
from lockstep.state import PartialState


def wait_for_everyone() -> None:
    """A barrier across all processes (no-op for one process)."""
    PartialState().wait_for_everyone()


__all__ = [
    "AutocastKwargs",
    "CannotPadNestedTensorWarning",
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
    "broadcast",
    "broadcast_object_list",
    "concatenate",
    "convert_outputs_to_fp32",
    "find_batch_size",
    "find_executable_batch_size",
    "gather",
    "gather_object",
    "honor_type",
    "is_namedtuple",
    "pad_across_processes",
    "recursively_apply",
    "reduce",
    "release_memory",
    "send_to_device",
    "set_seed",
    "synchronize_rng_state",
    "synchronize_rng_states",
    "wait_for_everyone",
]
