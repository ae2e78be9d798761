"""``accelerate.utils.imports``: what is installed, and which devices and number formats this machine has.

Each ``is_<package>_available()`` says whether the package can be imported (found on the path and, where
Accelerate checks it, installed as a distribution) without importing it. They report facts: lockstep itself
does not drive Megatron-LM, TPUs (torch_xla), MS-AMP, Transformer Engine or bitsandbytes even where those
are installed (the matching names in :mod:`lockstep.utils` raise ``NotImplementedError``); DeepSpeed it
drives through its DeepSpeed backend.

Example:
    >>> is_numpy_available(), is_torch_distributed_available()
    (True, True)
    >>> is_fp16_available()
    True
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from lockstep.utils.versions import compare_versions, is_torch_version

F = TypeVar("F", bound=Callable[..., Any])

__all__ = [
    "deepspeed_required",
    "get_ccl_version",
    "is_4bit_bnb_available",
    "is_8bit_bnb_available",
    "is_aim_available",
    "is_amdsmi_available",
    "is_bf16_available",
    "is_bitsandbytes_multi_backend_available",
    "is_bnb_available",
    "is_boto3_available",
    "is_ccl_available",
    "is_clearml_available",
    "is_comet_ml_available",
    "is_cuda_available",
    "is_datasets_available",
    "is_deepspeed_available",
    "is_dvclive_available",
    "is_fp8_available",
    "is_fp16_available",
    "is_habana_gaudi1",
    "is_hpu_available",
    "is_import_timer_available",
    "is_ipex_available",
    "is_lomo_available",
    "is_matplotlib_available",
    "is_megatron_lm_available",
    "is_mlflow_available",
    "is_mlu_available",
    "is_mps_available",
    "is_msamp_available",
    "is_musa_available",
    "is_neuron_available",
    "is_npu_available",
    "is_numpy_available",
    "is_pandas_available",
    "is_peft_available",
    "is_pippy_available",
    "is_pynvml_available",
    "is_pytest_available",
    "is_rich_available",
    "is_rocm_available",
    "is_sagemaker_available",
    "is_schedulefree_available",
    "is_sdaa_available",
    "is_swanlab_available",
    "is_tensorboard_available",
    "is_timm_available",
    "is_torch_distributed_available",
    "is_torch_xla_available",
    "is_torchao_available",
    "is_torchdata_available",
    "is_torchdata_stateful_dataloader_available",
    "is_torchvision_available",
    "is_tpu_available",
    "is_tqdm_available",
    "is_trackio_available",
    "is_transformer_engine_available",
    "is_transformer_engine_mxfp8_available",
    "is_transformers_available",
    "is_triton_available",
    "is_wandb_available",
    "is_weights_only_available",
    "is_xccl_available",
    "is_xpu_available",
    "torchao_required",
]


def _installed(module: str, *distributions: str) -> bool:
    """Whether ``module`` can be found and, when ``distributions`` are named, one of them is installed."""
    try:
        if importlib.util.find_spec(module) is None:
            return False
    except (ImportError, ValueError):  # a parent package that fails to import, or a broken __spec__
        return False
    return not distributions or any(_version(name) is not None for name in distributions)


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _at_least(distribution: str, minimum: str) -> bool:
    version = _version(distribution)
    return version is not None and compare_versions(distribution, ">=", minimum)


# -- devices and number formats ------------------------------------------------------------------------
def is_torch_distributed_available() -> bool:
    """Whether this torch build has ``torch.distributed``."""
    return torch.distributed.is_available()


def is_cuda_available() -> bool:
    """Whether a CUDA (or ROCm) GPU is usable."""
    return torch.cuda.is_available()


def is_rocm_available() -> bool:
    """Whether this torch is a ROCm (AMD GPU) build: ``torch.version.hip`` is set.

    Example:
        >>> is_rocm_available() == (torch.version.hip is not None)
        True
    """
    return torch.version.hip is not None


def is_xccl_available() -> bool:
    """Whether torch.distributed has Intel's XCCL backend (for XPUs; torch >= 2.7 built with it)."""
    if not is_torch_version(">=", "2.7.0"):
        return False
    return bool(torch.distributed.distributed_c10d.is_xccl_available())


def is_mps_available(min_version: str = "1.12") -> bool:
    """Whether Apple's MPS device is usable (with torch at least ``min_version``)."""
    return is_torch_version(">=", min_version) and torch.backends.mps.is_available()


def is_xpu_available(check_device: bool = False) -> bool:
    """Whether Intel XPUs are usable through stock torch (``check_device``: and at least one is present)."""
    xpu = getattr(torch, "xpu", None)
    if xpu is None or not xpu.is_available():
        return False
    return not check_device or xpu.device_count() > 0


def _vendor_device(package: str, device: str, check_device: bool) -> bool:
    """A device that needs a vendor plugin package (``torch_npu``...), which lockstep does not drive."""
    if not _installed(package):
        return False
    if not check_device:
        return True
    module = getattr(torch, device, None)
    return module is not None and module.is_available() and module.device_count() > 0


def is_npu_available(check_device: bool = False) -> bool:
    """Whether ``torch_npu`` (Ascend NPUs) is installed (``check_device``: and an NPU is present)."""
    return _vendor_device("torch_npu", "npu", check_device)


def is_mlu_available(check_device: bool = False) -> bool:
    """Whether ``torch_mlu`` (Cambricon MLUs) is installed (``check_device``: and an MLU is present)."""
    return _vendor_device("torch_mlu", "mlu", check_device)


def is_musa_available(check_device: bool = False) -> bool:
    """Whether ``torch_musa`` (Moore Threads GPUs) is installed (``check_device``: and one is present)."""
    return _vendor_device("torch_musa", "musa", check_device)


def is_hpu_available(init_hccl: bool = False) -> bool:
    """Whether Habana's ``habana_frameworks`` (Gaudi HPUs) is installed; ``init_hccl`` is not acted on."""
    return _installed("habana_frameworks")


def is_habana_gaudi1() -> bool:
    """Whether the HPU here is a first-generation Gaudi (which has no fp16); False without an HPU."""
    if not is_hpu_available():
        return False
    import habana_frameworks.torch.utils.experimental as htexp  # only where Habana's package is installed

    return bool(htexp._get_device_type() == htexp.synDeviceType.synDeviceGaudi)


def is_sdaa_available(check_device: bool = False) -> bool:
    """Whether ``torch_sdaa`` (Tecorigin SDAAs) is installed (``check_device``: and an SDAA is present)."""
    return _vendor_device("torch_sdaa", "sdaa", check_device)


def is_neuron_available(check_device: bool = False) -> bool:
    """Whether AWS Neuron's ``torch_neuronx`` (Trainium, Inferentia) is installed (``check_device``: and a
    Neuron device is present)."""
    return _vendor_device("torch_neuronx", "neuron", check_device)


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    """Whether ``torch_xla`` is installed (``check_is_tpu``/``check_is_gpu``: and drives that hardware).

    lockstep does not run on XLA devices; this only reports what is installed.
    """
    if not _installed("torch_xla"):
        return False
    if not (check_is_tpu or check_is_gpu):
        return True
    import torch_xla.runtime as xr  # only when asked about the hardware: importing it starts a runtime

    hardware = xr.device_type()
    return (check_is_tpu and hardware == "TPU") or (check_is_gpu and hardware in ("GPU", "CUDA"))


def is_tpu_available(check_device: bool = True) -> bool:
    """Accelerate's older name: whether a TPU is usable through ``torch_xla``."""
    return is_torch_xla_available(check_is_tpu=check_device)


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """Whether bf16 works here: the GPU supports it, or (on CPUs) always; on TPUs unless ``ignore_tpu``.

    Example:
        >>> is_bf16_available() if not torch.cuda.is_available() else True
        True
    """
    if is_torch_xla_available(check_is_tpu=True):
        return not ignore_tpu
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    if is_mps_available():
        return torch.backends.mps.is_macos_or_newer(14, 0)
    return True


def is_fp16_available() -> bool:
    """Whether fp16 mixed precision works here (it does wherever lockstep runs: CPU and GPUs)."""
    return True


def is_fp8_available() -> bool:
    """Whether an FP8 package (MS-AMP, Transformer Engine or torchao) is installed; lockstep has no FP8 backend."""
    return is_msamp_available() or is_transformer_engine_available() or is_torchao_available()


def is_weights_only_available() -> bool:
    """Whether ``torch.load(weights_only=True)`` has its safe-globals API (torch >= 2.4)."""
    return is_torch_version(">=", "2.4.0")


def is_pippy_available() -> bool:
    """Whether torch has pipeline parallelism built in (``torch.distributed.pipelining``, torch >= 2.4)."""
    return is_torch_version(">=", "2.4.0")


# -- packages ------------------------------------------------------------------------------------------
def is_numpy_available(min_version: str = "1.25.0") -> bool:
    """Whether NumPy of at least ``min_version`` is installed."""
    return _at_least("numpy", min_version)


def is_datasets_available() -> bool:
    """Whether Hugging Face ``datasets`` is installed."""
    return _installed("datasets")


def is_transformers_available() -> bool:
    """Whether Hugging Face ``transformers`` is installed."""
    return _installed("transformers")


def is_peft_available() -> bool:
    """Whether ``peft`` is installed."""
    return _installed("peft")


def is_timm_available() -> bool:
    """Whether ``timm`` is installed."""
    return _installed("timm")


def is_torchvision_available() -> bool:
    """Whether ``torchvision`` is installed."""
    return _installed("torchvision")


def is_torchdata_available() -> bool:
    """Whether ``torchdata`` is installed."""
    return _installed("torchdata")


def is_torchdata_stateful_dataloader_available() -> bool:
    """Whether ``torchdata`` with ``StatefulDataLoader`` (>= 0.8.0) is installed."""
    return _installed("torchdata") and _at_least("torchdata", "0.8.0")


def is_triton_available() -> bool:
    """Whether ``triton`` is installed."""
    return _installed("triton")


def is_tensorboard_available() -> bool:
    """Whether ``tensorboard`` (or ``tensorboardX``) is installed."""
    return _installed("tensorboard") or _installed("tensorboardX")


def is_wandb_available() -> bool:
    """Whether Weights & Biases (``wandb``) is installed."""
    return _installed("wandb")


def is_mlflow_available() -> bool:
    """Whether MLflow (``mlflow`` or ``mlflow-skinny``) is installed."""
    return _installed("mlflow", "mlflow", "mlflow-skinny")


def is_comet_ml_available() -> bool:
    """Whether ``comet_ml`` is installed."""
    return _installed("comet_ml")


def is_aim_available() -> bool:
    """Whether ``aim`` is installed."""
    return _installed("aim")


def is_clearml_available() -> bool:
    """Whether ``clearml`` is installed."""
    return _installed("clearml")


def is_dvclive_available() -> bool:
    """Whether ``dvclive`` is installed."""
    return _installed("dvclive")


def is_swanlab_available() -> bool:
    """Whether ``swanlab`` is installed."""
    return _installed("swanlab")


def is_trackio_available() -> bool:
    """Whether ``trackio`` is installed."""
    return _installed("trackio")


def is_pandas_available() -> bool:
    """Whether ``pandas`` is installed."""
    return _installed("pandas")


def is_matplotlib_available() -> bool:
    """Whether ``matplotlib`` is installed."""
    return _installed("matplotlib")


def is_rich_available() -> bool:
    """Whether ``rich`` is installed."""
    return _installed("rich")


def is_tqdm_available() -> bool:
    """Whether ``tqdm`` is installed."""
    return _installed("tqdm")


def is_boto3_available() -> bool:
    """Whether ``boto3`` is installed."""
    return _installed("boto3")


def is_sagemaker_available() -> bool:
    """Whether the ``sagemaker`` SDK is installed (lockstep does not launch on SageMaker)."""
    return _installed("sagemaker")


def is_pynvml_available() -> bool:
    """Whether ``pynvml`` (``nvidia-ml-py``) is installed."""
    return _installed("pynvml")


def is_pytest_available() -> bool:
    """Whether ``pytest`` is installed."""
    return _installed("pytest")


def is_schedulefree_available() -> bool:
    """Whether ``schedulefree`` is installed."""
    return _installed("schedulefree")


def is_lomo_available() -> bool:
    """Whether ``lomo_optim`` is installed."""
    return _installed("lomo_optim")


def is_import_timer_available() -> bool:
    """Whether ``import_timer`` is installed."""
    return _installed("import_timer")


def is_deepspeed_available() -> bool:
    """Whether ``deepspeed`` is installed (lockstep's DeepSpeed backend needs it: pip install deepspeed)."""
    return _installed("deepspeed", "deepspeed")


def is_megatron_lm_available() -> bool:
    """Whether Megatron-LM (``megatron.core``) is installed (lockstep does not drive it)."""
    return _installed("megatron") and _installed("megatron.core")


def is_msamp_available() -> bool:
    """Whether MS-AMP (``msamp``) is installed (lockstep has no FP8 backend)."""
    return _installed("msamp", "ms-amp")


def is_transformer_engine_available() -> bool:
    """Whether NVIDIA Transformer Engine is installed (lockstep has no FP8 backend)."""
    return _installed("transformer_engine")


def is_transformer_engine_mxfp8_available() -> bool:
    """Whether Transformer Engine is installed and reports MXFP8 support on this GPU (Blackwell and later)."""
    if not is_transformer_engine_available():
        return False
    import transformer_engine.pytorch as te  # only where Transformer Engine is installed

    return bool(te.fp8.check_mxfp8_support()[0])


def is_torchao_available() -> bool:
    """Whether ``torchao`` is installed (lockstep has no FP8 backend)."""
    return _installed("torchao")


def is_bnb_available(min_version: str | None = None) -> bool:
    """Whether ``bitsandbytes`` (of at least ``min_version``) is installed (lockstep does not integrate it)."""
    if not _installed("bitsandbytes", "bitsandbytes"):
        return False
    return min_version is None or _at_least("bitsandbytes", min_version)


def is_4bit_bnb_available() -> bool:
    """Whether bitsandbytes with 4-bit layers (>= 0.39.0) is installed."""
    return is_bnb_available("0.39.0")


def is_8bit_bnb_available() -> bool:
    """Whether bitsandbytes with 8-bit layers (>= 0.37.2) is installed."""
    return is_bnb_available("0.37.2")


def is_bitsandbytes_multi_backend_available() -> bool:
    """Whether the installed bitsandbytes is its multi-backend build (CPU, XPU... besides CUDA)."""
    if not is_bnb_available():
        return False
    import bitsandbytes  # only where it is installed

    return "multi_backend" in getattr(bitsandbytes, "features", set())


def is_ipex_available() -> bool:
    """Whether Intel Extension for PyTorch is installed (lockstep does not use it)."""
    return _installed("intel_extension_for_pytorch")


def is_ccl_available() -> bool:
    """Whether Intel's oneCCL bindings for torch are installed."""
    return _installed("oneccl_bindings_for_pytorch") or _installed("torch_ccl")


def is_amdsmi_available() -> bool:
    """Whether AMD's ``amdsmi`` (the ROCm system management library's Python bindings) is installed."""
    return _installed("amdsmi")


def get_ccl_version() -> str | None:
    """The installed oneCCL bindings' version, or ``None``."""
    return _version("oneccl_bind_pt")


# -- decorators ----------------------------------------------------------------------------------------
def torchao_required(func: F) -> F:
    """Decorate ``func`` so that calling it raises ``ImportError`` while ``torchao`` is not installed.

    Example:
        >>> @torchao_required
        ... def quantize():
        ...     return "quantized"
        >>> quantize() if is_torchao_available() else "ImportError"
        'ImportError'
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not is_torchao_available():
            raise ImportError(
                f"{func.__qualname__}() needs torchao, which is not installed: pip install torchao"
            )
        return func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def deepspeed_required(func: F) -> F:
    """Decorate ``func`` so that calling it raises ``ValueError`` once an Accelerator is set up for anything
    but DeepSpeed (before any Accelerator exists, the call goes through, as in Accelerate).

    After ``Accelerator(deepspeed_plugin=...)`` the call goes through; after any other ``Accelerator`` it
    raises.

    Example:
        >>> @deepspeed_required
        ... def zero_stage():
        ...     return 3
        >>> from lockstep import Accelerator
        >>> _ = Accelerator(cpu=True)
        >>> zero_stage()
        Traceback (most recent call last):
        ValueError: zero_stage() needs DeepSpeed, and the Accelerator is set up for NO. Pass Accelerator(deepspeed_plugin=DeepSpeedPlugin(...)) to train with DeepSpeed, or shard with FullyShardedDataParallelPlugin (FSDP2) and do not call zero_stage().
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # Here, not at the top: lockstep.state is not needed to ask what is installed.
        from lockstep.state import AcceleratorState

        if AcceleratorState.is_set_up():
            state = AcceleratorState()
            distributed_type = state.distributed_type
            if not state.uses_deepspeed:
                raise ValueError(
                    f"{func.__qualname__}() needs DeepSpeed, and the Accelerator is set up for "
                    f"{distributed_type.value}. Pass Accelerator(deepspeed_plugin=DeepSpeedPlugin(...)) to train "
                    "with DeepSpeed, or shard with FullyShardedDataParallelPlugin (FSDP2) and do not call "
                    f"{func.__qualname__}()."
                )
        return func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
