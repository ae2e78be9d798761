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

from lockstep._version import __version__

_EXPORTS = {
    "Accelerator": "lockstep.accelerator",
    "AcceleratorState": "lockstep.state",
    "GradientState": "lockstep.state",
    "PartialState": "lockstep.state",
    "AutocastKwargs": "lockstep.config",
    "DDPCommunicationHookType": "lockstep.config",
    "DataLoaderConfiguration": "lockstep.config",
    "DeepSpeedPlugin": "lockstep.utils",
    "DistributedDataParallelKwargs": "lockstep.config",
    "DistributedType": "lockstep.config",
    "DynamoBackend": "lockstep.config",
    "FullyShardedDataParallelPlugin": "lockstep.backends.fsdp.plugin",
    "GradScalerKwargs": "lockstep.config",
    "GradientAccumulationPlugin": "lockstep.config",
    "HangDetectionKwargs": "lockstep.diagnostics",
    "InitProcessGroupKwargs": "lockstep.config",
    "LoggerType": "lockstep.config",
    "ParallelismConfig": "lockstep.parallelism_config",
    "PrecisionType": "lockstep.config",
    "ProfileKwargs": "lockstep.config.kwargs",
    "ProjectConfiguration": "lockstep.config",
    "RNGType": "lockstep.config",
    "TorchDynamoPlugin": "lockstep.config",
    "ThroughputKwargs": "lockstep.throughput",
    "skip_first_batches": "lockstep.data",
    "debug_launcher": "lockstep.launcher",
    "notebook_launcher": "lockstep.launcher",
    "progress_bar": "lockstep.progress",
    "find_executable_batch_size": "lockstep.memory",
    "chunked_causal_lm_loss": "lockstep.layers.long_context",
    "skip_lm_head": "lockstep.layers.long_context",
    "release_memory": "lockstep.memory",
    "set_seed": "lockstep.rng",
    "synchronize_rng_states": "lockstep.rng",
    "init_empty_weights": "lockstep.big_modeling",
    "init_on_device": "lockstep.big_modeling",
    "cpu_offload": "lockstep.big_modeling",
    "cpu_offload_with_hook": "lockstep.big_modeling",
    "disk_offload": "lockstep.big_modeling",
    "dispatch_model": "lockstep.big_modeling",
    "infer_auto_device_map": "lockstep.utils.modeling",
    "load_checkpoint_and_dispatch": "lockstep.big_modeling",
    "prepare_pippy": "lockstep.inference",
    "is_rich_available": "lockstep.utils",
    "load_checkpoint_in_model": "lockstep.utils",
    "EvalPrediction": "lockstep.trainer",
    "Seq2SeqTrainer": "lockstep.trainer",
    "Seq2SeqTrainingArguments": "lockstep.trainer",
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
    "DeepSpeedPlugin",
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
    "ParallelismConfig",
    "PartialState",
    "PrecisionType",
    "ProfileKwargs",
    "ProjectConfiguration",
    "RNGType",
    "Seq2SeqTrainer",
    "Seq2SeqTrainingArguments",
    "ThroughputKwargs",
    "TorchDynamoPlugin",
    "Trainer",
    "TrainerCallback",
    "TrainerControl",
    "TrainerState",
    "TrainingArguments",
    "__version__",
    "chunked_causal_lm_loss",
    "cpu_offload",
    "cpu_offload_with_hook",
    "debug_launcher",
    "disk_offload",
    "dispatch_model",
    "find_executable_batch_size",
    "infer_auto_device_map",
    "init_empty_weights",
    "init_on_device",
    "is_rich_available",
    "load_checkpoint_and_dispatch",
    "load_checkpoint_in_model",
    "notebook_launcher",
    "prepare_pippy",
    "progress_bar",
    "release_memory",
    "set_seed",
    "skip_first_batches",
    "skip_lm_head",
    "synchronize_rng_states",
]

if TYPE_CHECKING:
    from lockstep.accelerator import Accelerator
    from lockstep.backends.fsdp.plugin import FullyShardedDataParallelPlugin
    from lockstep.big_modeling import (
        cpu_offload,
        cpu_offload_with_hook,
        disk_offload,
        dispatch_model,
        init_empty_weights,
        init_on_device,
        load_checkpoint_and_dispatch,
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
        LoggerType,
        PrecisionType,
        ProjectConfiguration,
        RNGType,
        TorchDynamoPlugin,
    )
    from lockstep.config.kwargs import ProfileKwargs
    from lockstep.data import skip_first_batches
    from lockstep.diagnostics import HangDetectionKwargs
    from lockstep.inference import prepare_pippy
    from lockstep.launcher import debug_launcher, notebook_launcher
    from lockstep.layers.long_context import chunked_causal_lm_loss, skip_lm_head
    from lockstep.memory import find_executable_batch_size, release_memory
    from lockstep.parallelism_config import ParallelismConfig
    from lockstep.progress import progress_bar
    from lockstep.rng import set_seed, synchronize_rng_states
    from lockstep.state import AcceleratorState, GradientState, PartialState
    from lockstep.throughput import ThroughputKwargs
    from lockstep.trainer import (
        EvalPrediction,
        Seq2SeqTrainer,
        Seq2SeqTrainingArguments,
        Trainer,
        TrainerCallback,
        TrainerControl,
        TrainerState,
        TrainingArguments,
    )
    from lockstep.utils import DeepSpeedPlugin, is_rich_available, load_checkpoint_in_model
    from lockstep.utils.modeling import infer_auto_device_map


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lockstep' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
