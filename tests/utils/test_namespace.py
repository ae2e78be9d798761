"""``lockstep.utils`` mirrors ``accelerate.utils``: Accelerate's names at the same paths (package, submodules,
top level), the same objects everywhere, importable without the facade, and ``import lockstep`` still free of
torch."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import lockstep
import lockstep.utils
from tests.helpers.cli import cli_env
from tests.test_architecture import imported_names, package_modules

# The names ``accelerate.utils`` exports (Accelerate 1.x ``utils/__init__.py``) that lockstep provides.
ACCELERATE_UTILS = """
MODEL_NAME OPTIMIZER_NAME RNG_STATE_NAME SAFE_MODEL_NAME SAFE_WEIGHTS_INDEX_NAME SAFE_WEIGHTS_NAME
SAFE_WEIGHTS_PATTERN_NAME SAMPLER_NAME SCALER_NAME SCHEDULER_NAME TORCH_DISTRIBUTED_OPERATION_TYPES
TORCH_LAUNCH_PARAMS WEIGHTS_INDEX_NAME WEIGHTS_NAME WEIGHTS_PATTERN_NAME PROFILE_PATTERN_NAME
AutocastKwargs BnbQuantizationConfig ComputeEnvironment CustomDtype DataLoaderConfiguration DDPCommunicationHookType
DeepSpeedPlugin DistributedDataParallelKwargs DistributedType DynamoBackend FP8RecipeKwargs
FullyShardedDataParallelPlugin GradientAccumulationPlugin GradScalerKwargs InitProcessGroupKwargs KwargsHandler
LoggerType MegatronLMPlugin PrecisionType ProjectConfiguration RNGType SageMakerDistributedType TensorInformation
TorchDynamoPlugin TorchTensorParallelPlugin add_model_config_to_megatron_parser
are_libraries_initialized check_cuda_p2p_ib_support check_fp8_capability clear_environment
convert_dict_to_env_variables get_cpu_distributed_information get_gpu_info get_int_from_env parse_choice_from_env
parse_flag_from_env patch_environment purge_accelerate_environment str_to_bool
get_ccl_version is_4bit_bnb_available is_8bit_bnb_available is_aim_available is_bf16_available is_bnb_available
is_boto3_available is_ccl_available is_clearml_available is_comet_ml_available is_cuda_available
is_datasets_available is_deepspeed_available is_dvclive_available is_fp8_available is_fp16_available
is_hpu_available is_import_timer_available is_ipex_available is_lomo_available is_megatron_lm_available
is_mlflow_available is_mlu_available is_mps_available is_msamp_available is_musa_available is_npu_available
is_pandas_available is_peft_available is_pippy_available is_pynvml_available is_pytest_available is_rich_available
is_sagemaker_available is_schedulefree_available is_tensorboard_available is_timm_available
is_torch_xla_available is_torchdata_available is_torchdata_stateful_dataloader_available is_torchvision_available
is_transformer_engine_available is_transformers_available is_triton_available is_wandb_available
is_weights_only_available is_xpu_available
calculate_maximum_sizes check_device_map check_tied_parameters_in_config check_tied_parameters_on_same_device
compute_module_sizes convert_file_size_to_int dtype_byte_size find_tied_parameters get_grad_scaler
get_max_layer_size get_max_memory get_mixed_precision_context_manager id_tensor_storage is_peft_model
load_checkpoint_in_model load_state_dict named_module_tensors retie_parameters set_module_tensor_to_device
CannotPadNestedTensorWarning GatheredParameters broadcast broadcast_object_list concatenate convert_outputs_to_fp32
convert_to_fp32 copy_tensor_to_devices find_batch_size find_device gather gather_object get_data_structure
honor_type ignorant_find_batch_size initialize_tensors is_namedtuple is_tensor_information is_torch_tensor listify
pad_across_processes pad_input_tensors recursively_apply reduce send_to_device slice_tensors
compare_versions is_torch_version
DeepSpeedEngineWrapper DeepSpeedOptimizerWrapper DeepSpeedSchedulerWrapper DummyOptim DummyScheduler
HfDeepSpeedConfig get_active_deepspeed_plugin map_pytorch_optim_to_deepspeed
has_4bit_bnb_layers load_and_quantize_model merge_fsdp_weights prepare_sagemager_args_inputs
AbstractTrainStep BertTrainStep GPTTrainStep MegatronEngine MegatronLMDummyDataLoader MegatronLMDummyScheduler
MegatronLMOptimizerWrapper MegatronLMSchedulerWrapper T5TrainStep avg_losses_across_data_parallel_group
gather_across_data_parallel_groups find_executable_batch_size release_memory
check_os_kernel clean_state_dict_for_safetensors convert_bytes extract_model_from_parallel get_pretty_name
is_port_in_use load merge_dicts recursive_getattr save wait_for_everyone write_basic_config
set_seed synchronize_rng_state synchronize_rng_states install_xla tqdm
apply_fp8_autowrap contextual_fp8_autocast convert_model has_transformer_engine_layers
""".split()

SUBMODULES = [
    "constants",
    "dataclasses",
    "environment",
    "imports",
    "memory",
    "modeling",
    "offload",
    "operations",
    "other",
    "random",
    "versions",
    "fsdp_utils",
    "tqdm",
    "deepspeed",
    "megatron_lm",
    "bnb",
    "transformer_engine",
    "torch_xla",
    "ao",
    "launch",
]


def test_every_accelerate_utils_name_is_provided():
    missing = [name for name in ACCELERATE_UTILS if not hasattr(lockstep.utils, name)]
    assert missing == []
    assert set(ACCELERATE_UTILS) <= set(lockstep.utils.__all__)
    assert all(hasattr(lockstep.utils, name) for name in lockstep.utils.__all__)


# lockstep.utils' names beyond Accelerate 1.15's ``accelerate.utils`` (older Accelerate names, and the
# helpers of the collectives and memory modules), pinned when the package's list became derived.
LOCKSTEP_EXTRAS = """
ConvertOutputsToFp32 DistributedOperationException check_fp8_capability clear_device_cache get_ccl_version
get_free_port is_ccl_available is_ipex_available is_numpy_available is_torch_distributed_available
is_tpu_available is_tqdm_available should_reduce_batch_size
""".split()


def accelerate_utils_names() -> dict[str, str]:
    """accelerate_api.json's ``utils`` section: Accelerate 1.15's ``accelerate.utils`` names -> status."""
    data = json.loads((Path(lockstep.__file__).parent / "accelerate_api.json").read_text(encoding="utf-8"))
    return data["sections"]["utils"]["names"]


def test_the_package_exports_exactly_what_its_submodules_list():
    """``lockstep.utils.__all__`` is derived from the submodules' ``__all__``; the names it held as a
    hand-kept list (266) are all still there, and nothing else."""
    listed = accelerate_utils_names()
    resolved = {name for name, entry in listed.items() if not entry.startswith("absent")}
    assert len(resolved) == 253 and len(lockstep.utils.__all__) == 266
    assert set(lockstep.utils.__all__) == resolved | set(LOCKSTEP_EXTRAS)
    assert sorted(lockstep.utils.__all__) == lockstep.utils.__all__
    modules = [importlib.import_module(f"lockstep.utils.{name}") for name in lockstep.utils._SUBMODULES]
    assert sorted(lockstep.utils._SUBMODULES) == sorted(SUBMODULES)
    listed_by_submodules = {name for module in modules for name in module.__all__}
    assert set(lockstep.utils.__all__) == listed_by_submodules - lockstep.utils._SUBMODULE_ONLY
    # The names kept out are no names of accelerate.utils, and each is public in its submodule.
    assert lockstep.utils._SUBMODULE_ONLY <= listed_by_submodules
    assert not lockstep.utils._SUBMODULE_ONLY & set(listed)


def test_a_name_a_submodule_adds_to_its_all_is_exported_and_submodule_only_names_are_not():
    module = type(sys)("lockstep.utils.fake")
    module.__all__ = ["fresh_name", "torch_version"]
    module.fresh_name, module.torch_version = object(), "2.13"
    assert lockstep.utils._exports([module]) == {"fresh_name": module.fresh_name}


@pytest.mark.parametrize("submodule", SUBMODULES)
def test_submodule_paths_hold_the_same_objects(submodule):
    module = importlib.import_module(f"lockstep.utils.{submodule}")
    assert module.__all__, submodule
    for name in module.__all__:
        value = getattr(module, name)
        if name in lockstep.utils.__all__:
            assert getattr(lockstep.utils, name) is value, f"lockstep.utils.{submodule}.{name}"


def test_lockstep_utils_reexports_the_engine_objects():
    from lockstep import collectives, config, rng
    from lockstep._nested import concatenate

    assert lockstep.utils.gather is collectives.gather and lockstep.utils.reduce is collectives.reduce
    assert lockstep.utils.set_seed is rng.set_seed and lockstep.utils.concatenate is concatenate
    assert (
        lockstep.utils.LoggerType is config.LoggerType
        and lockstep.utils.KwargsHandler is config.KwargsHandler
    )


@pytest.mark.parametrize(
    ("name", "module"),
    [
        ("init_empty_weights", "lockstep.big_modeling"),
        ("init_on_device", "lockstep.big_modeling"),
        ("load_checkpoint_in_model", "lockstep.utils"),
        ("is_rich_available", "lockstep.utils"),
        ("synchronize_rng_states", "lockstep.utils"),
        ("DeepSpeedPlugin", "lockstep.utils"),
    ],
)
def test_top_level_names_accelerate_exports(name, module):
    assert name in lockstep.__all__ and name in dir(lockstep)
    assert getattr(lockstep, name) is getattr(importlib.import_module(module), name)


# The one import of the Accelerator's package that lockstep.utils makes, and why: Accelerate's ``accelerate.utils``
# exports the optimizer and scheduler the loop holds under DeepSpeed, which are wrappers of the Accelerator's
# own AcceleratedOptimizer/AcceleratedScheduler; lockstep.utils re-exports them under those names.
RE_EXPORTED_FROM_THE_ACCELERATOR = {
    ("lockstep.utils", "lockstep.accelerator.engine_stepped"),
    ("lockstep.utils.deepspeed", "lockstep.accelerator.engine_stepped"),
}


def test_utils_sits_below_the_facade():
    modules = [m for m in package_modules() if m.name.startswith(("lockstep.utils", "lockstep.big_modeling"))]
    assert {"lockstep.utils", "lockstep.utils.operations", "lockstep.big_modeling"} <= {
        m.name for m in modules
    }
    known = {m.name for m in package_modules()}
    forbidden = ("lockstep.accelerator", "lockstep.trainer", "lockstep.cli", "lockstep.launcher")
    found = [
        f"{m.name}:{line} imports {name}"
        for m in modules
        for name, line in imported_names(m, known)
        if name.startswith(forbidden) and (m.name, name) not in RE_EXPORTED_FROM_THE_ACCELERATOR
    ]
    assert found == []


def test_import_lockstep_stays_free_of_torch():
    probe = "import sys, lockstep; lockstep.__all__; dir(lockstep); print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=cli_env(), timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
