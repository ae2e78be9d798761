"""Accelerate names for hardware and integrations lockstep does not drive: they import, and using them raises.

Code written for Accelerate often imports these names at the top of a script and uses them only on one
kind of machine (``MegatronLMPlugin`` with Megatron-LM, ``install_xla`` in a Colab cell). So they
exist under Accelerate's names and paths, and calling a function or constructing a class raises
``NotImplementedError`` naming the feature, why lockstep lacks it, and what to use instead.

Example:
    >>> MegatronLMPlugin()
    Traceback (most recent call last):
    NotImplementedError: MegatronLMPlugin is not supported by lockstep: lockstep does not drive Megatron-LM. Train with FullyShardedDataParallelPlugin (FSDP2) or plain data parallelism (DDP).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn


@dataclass(frozen=True)
class Feature:
    """An integration lockstep does not drive, and what to use instead."""

    reason: str
    instead: str

    def message(self, name: str) -> str:
        return f"{name} is not supported by lockstep: {self.reason}. {self.instead}"


DEEPSPEED = Feature(
    "this part of Accelerate's DeepSpeed integration is not built in lockstep (its DeepSpeed backend trains "
    "ZeRO 0-3 through DeepSpeedPlugin, DummyOptim and DummyScheduler)",
    "Configure DeepSpeed with lockstep.utils.DeepSpeedPlugin and pass a torch optimizer or DummyOptim to prepare().",
)
MEGATRON_LM = Feature(
    "lockstep does not drive Megatron-LM",
    "Train with FullyShardedDataParallelPlugin (FSDP2) or plain data parallelism (DDP).",
)
XLA = Feature(
    "lockstep runs on CPUs and CUDA, MPS or XPU devices through torch.distributed, not on TPUs (torch_xla)",
    "Train on GPUs or CPUs.",
)
BITSANDBYTES = Feature(
    "lockstep does not integrate bitsandbytes quantization",
    "Quantize the model with bitsandbytes (or transformers' BitsAndBytesConfig) before preparing it.",
)
FP8 = Feature(
    "lockstep has no FP8 backend (Transformer Engine, MS-AMP or torchao)",
    "Use mixed_precision='bf16' (or 'fp16').",
)
SAGEMAKER = Feature(
    "lockstep does not launch jobs on Amazon SageMaker",
    "Start the processes on the instances with `lockstep launch` or torchrun.",
)
TENSOR_PARALLEL = Feature(
    "Accelerate's deprecated tensor-parallel plugin is not built",
    "Pass Accelerator(parallelism_config=ParallelismConfig(tp_size=...)) instead.",
)


def unsupported_function(name: str, feature: Feature) -> Callable[..., NoReturn]:
    """A function called ``name`` that raises ``NotImplementedError`` explaining ``feature``."""
    message = feature.message(name)

    def unsupported(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(message)

    unsupported.__name__ = unsupported.__qualname__ = name
    unsupported.__doc__ = f"Not supported: raises NotImplementedError.\n\n{message}"
    return unsupported


def unsupported_class(name: str, feature: Feature) -> type:
    """A class called ``name`` whose construction raises ``NotImplementedError`` explaining ``feature``."""
    message = feature.message(name)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(message)

    namespace = {"__init__": __init__, "__doc__": f"Not supported: raises NotImplementedError.\n\n{message}"}
    namespace["__module__"] = __name__
    return type(name, (), namespace)


# -- DeepSpeed (accelerate.utils.deepspeed, accelerate.utils.dataclasses) --------------------------------
HfDeepSpeedConfig = unsupported_class("HfDeepSpeedConfig", DEEPSPEED)
get_active_deepspeed_plugin = unsupported_function("get_active_deepspeed_plugin", DEEPSPEED)
map_pytorch_optim_to_deepspeed = unsupported_function("map_pytorch_optim_to_deepspeed", DEEPSPEED)

# -- Megatron-LM (accelerate.utils.megatron_lm) ------------------------------------------------------
MegatronLMPlugin = unsupported_class("MegatronLMPlugin", MEGATRON_LM)
MegatronEngine = unsupported_class("MegatronEngine", MEGATRON_LM)
MegatronLMDummyDataLoader = unsupported_class("MegatronLMDummyDataLoader", MEGATRON_LM)
MegatronLMDummyScheduler = unsupported_class("MegatronLMDummyScheduler", MEGATRON_LM)
MegatronLMOptimizerWrapper = unsupported_class("MegatronLMOptimizerWrapper", MEGATRON_LM)
MegatronLMSchedulerWrapper = unsupported_class("MegatronLMSchedulerWrapper", MEGATRON_LM)
AbstractTrainStep = unsupported_class("AbstractTrainStep", MEGATRON_LM)
BertTrainStep = unsupported_class("BertTrainStep", MEGATRON_LM)
GPTTrainStep = unsupported_class("GPTTrainStep", MEGATRON_LM)
T5TrainStep = unsupported_class("T5TrainStep", MEGATRON_LM)
avg_losses_across_data_parallel_group = unsupported_function(
    "avg_losses_across_data_parallel_group", MEGATRON_LM
)
gather_across_data_parallel_groups = unsupported_function("gather_across_data_parallel_groups", MEGATRON_LM)
add_model_config_to_megatron_parser = unsupported_function("add_model_config_to_megatron_parser", MEGATRON_LM)
# Accelerate exports these five only where Megatron-LM is installed (accelerate.utils.megatron_lm's
# initialize, prepare_data_loader, ... under a megatron_lm_ prefix).
megatron_lm_initialize = unsupported_function("megatron_lm_initialize", MEGATRON_LM)
megatron_lm_prepare_data_loader = unsupported_function("megatron_lm_prepare_data_loader", MEGATRON_LM)
megatron_lm_prepare_model_optimizer_scheduler = unsupported_function(
    "megatron_lm_prepare_model_optimizer_scheduler", MEGATRON_LM
)
megatron_lm_prepare_optimizer = unsupported_function("megatron_lm_prepare_optimizer", MEGATRON_LM)
megatron_lm_prepare_scheduler = unsupported_function("megatron_lm_prepare_scheduler", MEGATRON_LM)

# -- TPUs (accelerate.utils.torch_xla) ---------------------------------------------------------------
install_xla = unsupported_function("install_xla", XLA)

# -- bitsandbytes (accelerate.utils.bnb) -------------------------------------------------------------
BnbQuantizationConfig = unsupported_class("BnbQuantizationConfig", BITSANDBYTES)
load_and_quantize_model = unsupported_function("load_and_quantize_model", BITSANDBYTES)
has_4bit_bnb_layers = unsupported_function("has_4bit_bnb_layers", BITSANDBYTES)

# -- FP8: Transformer Engine, MS-AMP, torchao (accelerate.utils.transformer_engine, .dataclasses) -------
FP8RecipeKwargs = unsupported_class("FP8RecipeKwargs", FP8)
TERecipeKwargs = unsupported_class("TERecipeKwargs", FP8)
MSAMPRecipeKwargs = unsupported_class("MSAMPRecipeKwargs", FP8)
AORecipeKwargs = unsupported_class("AORecipeKwargs", FP8)
convert_model = unsupported_function("convert_model", FP8)
has_transformer_engine_layers = unsupported_function("has_transformer_engine_layers", FP8)
apply_fp8_autowrap = unsupported_function("apply_fp8_autowrap", FP8)
contextual_fp8_autocast = unsupported_function("contextual_fp8_autocast", FP8)
convert_model_to_fp8_ao = unsupported_function("convert_model_to_fp8_ao", FP8)
filter_first_and_last_linear_layers = unsupported_function("filter_first_and_last_linear_layers", FP8)
has_ao_layers = unsupported_function("has_ao_layers", FP8)

# -- SageMaker (accelerate.utils.launch) -------------------------------------------------------------
prepare_sagemager_args_inputs = unsupported_function("prepare_sagemager_args_inputs", SAGEMAKER)

# -- tensor parallelism (accelerate.utils.dataclasses) -----------------------------------------------
TorchTensorParallelPlugin = unsupported_class("TorchTensorParallelPlugin", TENSOR_PARALLEL)

# -- sequence parallelism (accelerate.utils.dataclasses) ------------------------------------------------
DeepSpeedSequenceParallelConfig = unsupported_class("DeepSpeedSequenceParallelConfig", DEEPSPEED)
