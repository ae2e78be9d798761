"""``accelerate.utils.dataclasses``: the enums, ``*Kwargs`` handlers, plugins and small records.

The settings themselves live in :mod:`lockstep.config` and are re-exported here under Accelerate's names.
This module adds the few records Accelerate keeps next to them (:class:`ComputeEnvironment`,
:class:`SageMakerDistributedType`, :class:`CustomDtype`, :class:`TensorInformation`) and the plugins and
recipes of integrations lockstep does not drive, which import fine and raise ``NotImplementedError`` when
constructed (see :mod:`lockstep.utils.unsupported`).

Example:
    >>> PrecisionType("bf16") == "bf16"
    True
    >>> str(ComputeEnvironment.LOCAL_MACHINE)
    'LOCAL_MACHINE'
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lockstep.backends.deepspeed.plugin import DeepSpeedPlugin
from lockstep.backends.fsdp.plugin import FullyShardedDataParallelPlugin
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
from lockstep.config.enums import StrEnumBase
from lockstep.config.kwargs import FP8BackendType, ProfileKwargs
from lockstep.config.parallelism import (
    ParallelismConfig,
    TorchContextParallelConfig,
    TorchTensorParallelConfig,
)
from lockstep.utils.unsupported import (
    AORecipeKwargs,
    BnbQuantizationConfig,
    DeepSpeedSequenceParallelConfig,
    FP8RecipeKwargs,
    MegatronLMPlugin,
    MSAMPRecipeKwargs,
    TERecipeKwargs,
    TorchTensorParallelPlugin,
    add_model_config_to_megatron_parser,
)

__all__ = [
    "AORecipeKwargs",
    "AutocastKwargs",
    "BnbQuantizationConfig",
    "ComputeEnvironment",
    "CustomDtype",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "DeepSpeedSequenceParallelConfig",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "DynamoBackend",
    "FP8BackendType",
    "FP8RecipeKwargs",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "LoggerType",
    "MSAMPRecipeKwargs",
    "MegatronLMPlugin",
    "ParallelismConfig",
    "PrecisionType",
    "ProfileKwargs",
    "ProjectConfiguration",
    "RNGType",
    "SageMakerDistributedType",
    "TERecipeKwargs",
    "TensorInformation",
    "TorchContextParallelConfig",
    "TorchDynamoPlugin",
    "TorchTensorParallelConfig",
    "TorchTensorParallelPlugin",
    "add_model_config_to_megatron_parser",
]


class ComputeEnvironment(StrEnumBase):
    """Where a job runs (the config file's ``compute_environment``).

    lockstep runs on ``LOCAL_MACHINE`` (machines you reach yourself); ``AMAZON_SAGEMAKER`` is accepted as a
    value so that Accelerate's files and code load, and launching on SageMaker is not supported.
    """

    LOCAL_MACHINE = "LOCAL_MACHINE"
    AMAZON_SAGEMAKER = "AMAZON_SAGEMAKER"


class SageMakerDistributedType(StrEnumBase):
    """SageMaker's distributed modes, as values only: lockstep does not launch on SageMaker."""

    NO = "NO"
    DATA_PARALLEL = "DATA_PARALLEL"
    MODEL_PARALLEL = "MODEL_PARALLEL"


class CustomDtype(StrEnumBase):
    """Element types torch has no dtype for, used when sizing quantized weights (see ``dtype_byte_size``)."""

    FP8 = "fp8"
    INT4 = "int4"
    INT2 = "int2"


@dataclass
class TensorInformation:
    """The shape and dtype of a tensor, to rebuild an empty one elsewhere (see ``initialize_tensors``).

    Example:
        >>> TensorInformation(shape=torch.Size([2, 3]), dtype=torch.float16)
        TensorInformation(shape=torch.Size([2, 3]), dtype=torch.float16)
    """

    shape: torch.Size
    dtype: torch.dtype
