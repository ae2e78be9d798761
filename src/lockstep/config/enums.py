"""String enums for settings. They compare equal to their values and serialize as plain strings."""

from __future__ import annotations

import warnings
from enum import Enum
from typing import Any


class StrEnumBase(str, Enum):
    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: object, *, argument: str) -> StrEnumBase:
        """Turn a user value into a member, or raise a ValueError that lists the choices."""
        if isinstance(value, cls):
            return value
        text = str(value).strip()
        for member in cls:
            if text.lower() == member.value.lower() or text.upper() == member.name:
                return member
        choices = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"{argument}={value!r} is invalid: it must be one of {choices}.")


class _DeprecatedMember:
    """An old member name that reads as its replacement, with Accelerate's ``FutureWarning``.

    A descriptor is not turned into an enum member, so iteration and ``parse`` never see the old name.
    """

    def __init__(self, name: str, replaced_with: str) -> None:
        self.name = name
        self.replaced_with = replaced_with

    def __get__(self, instance: Any, owner: type[Enum]) -> Enum:
        warnings.warn(
            f"The `{self.name}` of `{owner}` is deprecated and will be removed in v1.0.0. "
            f"Please use the `{self.replaced_with}` instead.",
            FutureWarning,
            stacklevel=2,
        )
        return owner[self.replaced_with]


class DistributedType(StrEnumBase):
    """How the processes of a run share the work.

    ``NO`` is a single process; ``MULTI_CPU`` and ``MULTI_GPU`` are data parallel (DDP) on CPUs or GPUs;
    ``FSDP`` and ``DEEPSPEED`` shard the model. ``TPU`` is Accelerate's deprecated spelling of ``XLA``
    (transformers' ``*_no_trainer.py`` examples still test ``distributed_type == DistributedType.TPU``).
    """

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_XPU = "MULTI_XPU"
    MULTI_MPS = "MULTI_MPS"
    FSDP = "FSDP"
    DEEPSPEED = "DEEPSPEED"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"
    TPU = _DeprecatedMember("TPU", "XLA")


class PrecisionType(StrEnumBase):
    """The ``mixed_precision`` choices."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    FP8 = "fp8"


class DynamoBackend(StrEnumBase):
    """``torch.compile`` backends selectable through ``dynamo_backend``."""

    NO = "no"
    EAGER = "eager"
    AOT_EAGER = "aot_eager"
    INDUCTOR = "inductor"
    AOT_TS_NVFUSER = "aot_ts_nvfuser"
    NVPRIMS_NVFUSER = "nvprims_nvfuser"
    CUDAGRAPHS = "cudagraphs"
    OFI = "ofi"
    FX2TRT = "fx2trt"
    ONNXRT = "onnxrt"
    TENSORRT = "tensorrt"
    AOT_TORCHXLA_TRACE_ONCE = "aot_torchxla_trace_once"
    TORCHXLA_TRACE_ONCE = "torchxla_trace_once"
    IPEX = "ipex"
    TVM = "tvm"


class RNGType(StrEnumBase):
    """Random number generators that prepared dataloaders synchronize from rank 0."""

    TORCH = "torch"
    CUDA = "cuda"
    MPS = "mps"
    XLA = "xla"
    XPU = "xpu"
    GENERATOR = "generator"


class DDPCommunicationHookType(StrEnumBase):
    """Gradient communication hooks for DDP (see ``torch.distributed.algorithms.ddp_comm_hooks``)."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


BUILT_IN_TRACKERS: dict[str, str] = {
    "jsonl": "lockstep.tracking.files:JSONLTracker",
    "csv": "lockstep.tracking.files:CSVTracker",
    "tensorboard": "lockstep.tracking.tensorboard:TensorBoardTracker",
    "mlflow": "lockstep.tracking.mlflow:MLflowTracker",
    "wandb": "lockstep.tracking.wandb:WandBTracker",
}
"""lockstep's own experiment trackers, the one table of them: ``log_with`` name -> ``"module:Class"``.

``lockstep.tracking`` registers each class with ``register_tracker_class``, the call a user's tracker goes
through; :class:`LoggerType`'s members, ``log_with="all"``, ``lockstep env`` and the Trainer's ``report_to``
choices are read from what is registered. A new built-in tracker is its module plus one line here. The
classes are named as text so that this vocabulary imports no tracker.
"""

LoggerType = StrEnumBase(  # type: ignore[misc]  # members made from BUILT_IN_TRACKERS
    "LoggerType",
    {"ALL": "all", **{name.upper(): name for name in BUILT_IN_TRACKERS}},
    module=__name__,
    qualname="LoggerType",
)
LoggerType.__doc__ = """The built-in experiment trackers' names (Accelerate's ``LoggerType``), and ``ALL``.

Made from :data:`BUILT_IN_TRACKERS`: ``LoggerType.JSONL == "jsonl"``, ``LoggerType.TENSORBOARD``... A
tracker registered with ``lockstep.tracking.register_tracker_class`` is accepted by ``log_with`` by its
name without being a member, as in Accelerate.

Example:
    >>> LoggerType.TENSORBOARD == "tensorboard", LoggerType("all") is LoggerType.ALL
    (True, True)
"""
