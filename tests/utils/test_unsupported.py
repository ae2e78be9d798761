"""Accelerate names for hardware and integrations lockstep does not drive import fine and, when used, raise
NotImplementedError naming the feature and what to use instead."""

from __future__ import annotations

import importlib

import pytest

import lockstep
import lockstep.utils

# name -> (submodule it is also importable from, words the error must contain)
UNSUPPORTED = {
    "DeepSpeedPlugin": ("dataclasses", "no DeepSpeed backend"),
    "DummyOptim": ("deepspeed", "no DeepSpeed backend"),
    "DummyScheduler": ("deepspeed", "no DeepSpeed backend"),
    "HfDeepSpeedConfig": ("deepspeed", "no DeepSpeed backend"),
    "DeepSpeedEngineWrapper": ("deepspeed", "no DeepSpeed backend"),
    "get_active_deepspeed_plugin": ("deepspeed", "no DeepSpeed backend"),
    "MegatronLMPlugin": ("dataclasses", "does not drive Megatron-LM"),
    "GPTTrainStep": ("megatron_lm", "does not drive Megatron-LM"),
    "MegatronEngine": ("megatron_lm", "does not drive Megatron-LM"),
    "avg_losses_across_data_parallel_group": ("megatron_lm", "does not drive Megatron-LM"),
    "install_xla": ("torch_xla", "not on TPUs (torch_xla)"),
    "BnbQuantizationConfig": ("dataclasses", "does not integrate bitsandbytes"),
    "load_and_quantize_model": ("bnb", "does not integrate bitsandbytes"),
    "has_4bit_bnb_layers": ("bnb", "does not integrate bitsandbytes"),
    "FP8RecipeKwargs": ("dataclasses", "no FP8 backend"),
    "TERecipeKwargs": ("dataclasses", "no FP8 backend"),
    "MSAMPRecipeKwargs": ("dataclasses", "no FP8 backend"),
    "AORecipeKwargs": ("dataclasses", "no FP8 backend"),
    "convert_model": ("transformer_engine", "no FP8 backend"),
    "has_transformer_engine_layers": ("transformer_engine", "no FP8 backend"),
    "TorchTensorParallelPlugin": ("dataclasses", "tensor parallelism is not built yet"),
    "prepare_sagemager_args_inputs": (None, "does not launch jobs on Amazon SageMaker"),
}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_names_import_and_raise_when_used(name):
    submodule, reason = UNSUPPORTED[name]
    value = getattr(lockstep.utils, name)
    if submodule is not None:
        assert getattr(importlib.import_module(f"lockstep.utils.{submodule}"), name) is value
    assert value.__name__ == name and "Not supported" in value.__doc__
    with pytest.raises(NotImplementedError) as caught:
        value(object(), key="anything")  # whatever is passed: constructing or calling raises
    message = str(caught.value)
    assert message.startswith(f"{name} is not supported by lockstep: ")
    assert reason in message


def test_unsupported_classes_stay_classes():
    assert isinstance(lockstep.utils.DeepSpeedPlugin, type)
    assert not isinstance(object(), lockstep.utils.DummyOptim)  # isinstance checks in user code work
    assert lockstep.DeepSpeedPlugin is lockstep.utils.DeepSpeedPlugin
    with pytest.raises(NotImplementedError, match="Shard the model with FullyShardedDataParallelPlugin"):
        lockstep.DeepSpeedPlugin(zero_stage=2)
