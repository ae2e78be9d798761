"""Accelerate names for hardware and integrations lockstep does not drive import fine and, when used, raise
NotImplementedError naming the feature and what to use instead."""

from __future__ import annotations

import importlib

import pytest

import lockstep
import lockstep.utils

# name -> (submodule it is also importable from, words the error must contain)
UNSUPPORTED = {
    "HfDeepSpeedConfig": ("deepspeed", "DeepSpeed integration is not built"),
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
    "TorchTensorParallelPlugin": ("dataclasses", "deprecated tensor-parallel plugin is not built"),
    "prepare_sagemager_args_inputs": (None, "does not launch jobs on Amazon SageMaker"),
    "DeepSpeedSequenceParallelConfig": ("dataclasses", "DeepSpeed integration is not built"),
    "convert_model_to_fp8_ao": ("ao", "no FP8 backend"),
    "filter_first_and_last_linear_layers": ("ao", "no FP8 backend"),
    "has_ao_layers": ("ao", "no FP8 backend"),
    "megatron_lm_initialize": ("megatron_lm", "does not drive Megatron-LM"),
    "megatron_lm_prepare_data_loader": ("megatron_lm", "does not drive Megatron-LM"),
    "megatron_lm_prepare_model_optimizer_scheduler": ("megatron_lm", "does not drive Megatron-LM"),
    "megatron_lm_prepare_optimizer": ("megatron_lm", "does not drive Megatron-LM"),
    "megatron_lm_prepare_scheduler": ("megatron_lm", "does not drive Megatron-LM"),
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
    assert isinstance(lockstep.utils.HfDeepSpeedConfig, type)
    assert not isinstance(object(), lockstep.utils.HfDeepSpeedConfig)  # isinstance checks in user code work
    assert lockstep.DeepSpeedPlugin is lockstep.utils.DeepSpeedPlugin
    with pytest.raises(NotImplementedError, match="Configure DeepSpeed with lockstep.utils.DeepSpeedPlugin"):
        lockstep.utils.HfDeepSpeedConfig({})


def test_top_level_and_utils_share_the_stand_ins():
    assert lockstep.ParallelismConfig is lockstep.utils.ParallelismConfig
    assert lockstep.ParallelismConfig.__module__ == "lockstep.config.parallelism"
    assert lockstep.infer_auto_device_map is lockstep.utils.infer_auto_device_map
