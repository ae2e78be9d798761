"""``accelerate.utils.environment``: reading, patching and clearing environment variables, and machine facts.

lockstep reads its own variables (``LOCKSTEP_*``, the launchers' ``RANK``...) in :mod:`lockstep._env`; the
helpers here are the general-purpose ones Accelerate exports for user code and tests.

Example:
    >>> import os
    >>> with patch_environment(my_flag="yes", retries=3):
    ...     parse_flag_from_env("MY_FLAG"), get_int_from_env(["RETRIES"], 0)
    (True, 3)
    >>> "MY_FLAG" in os.environ
    False
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import os
import platform
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from packaging.version import parse

from lockstep import _env

__all__ = [
    "CPUInformation",
    "are_libraries_initialized",
    "check_cuda_fp8_capability",
    "check_cuda_p2p_ib_support",
    "check_fp8_capability",
    "clear_environment",
    "convert_dict_to_env_variables",
    "get_cpu_distributed_information",
    "get_current_device_type",
    "get_driver_version",
    "get_gpu_info",
    "get_int_from_env",
    "parse_choice_from_env",
    "parse_flag_from_env",
    "patch_environment",
    "purge_accelerate_environment",
    "set_numa_affinity",
    "str_to_bool",
]

T = TypeVar("T")
_TRUE = ("y", "yes", "t", "true", "on", "1")
_FALSE = ("n", "no", "f", "false", "off", "0")
_FORBIDDEN_ENV_CHARACTERS = (";", "\n", "<", ">", " ")
# Variables Accelerate and lockstep set for the processes they start, and that purge_accelerate_environment
# removes again.
_OWN_PREFIXES = ("ACCELERATE_", "LOCKSTEP_")


def str_to_bool(value: str, to_bool: bool = False) -> int | bool:
    """``1`` for y, yes, t, true, on, 1 and ``0`` for n, no, f, false, off, 0 (any case), as Accelerate;
    ``True``/``False`` instead with ``to_bool``.

    Raises:
        ValueError: any other string.

    Example:
        >>> str_to_bool("Yes"), str_to_bool("off"), str_to_bool("on", to_bool=True)
        (1, 0, True)
    """
    text = str(value).strip().lower()
    if text in _TRUE:
        return True if to_bool else 1
    if text in _FALSE:
        return False if to_bool else 0
    raise ValueError(
        f"str_to_bool({value!r}) is invalid: it is not a truth value. Use one of {', '.join(_TRUE)} "
        f"or {', '.join(_FALSE)}."
    )


def get_int_from_env(env_keys: Iterable[str], default: T) -> int | T:
    """The first of ``env_keys`` set to a non-negative integer, else ``default``.

    Raises:
        ValueError: a listed variable holds something that is not an integer.
    """
    for key in env_keys:
        raw = os.environ.get(key)
        if raw is None or raw.strip() == "":
            continue
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(
                f"Environment variable {key}={raw!r} is invalid: it must be an integer."
            ) from None
        if value >= 0:
            return value
    return default


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    """Whether the variable ``key`` holds a true value (see :func:`str_to_bool`); ``default`` when unset."""
    raw = os.environ.get(key)
    if raw is None:
        return default
    try:
        return str_to_bool(raw) == 1
    except ValueError:
        raise ValueError(
            f"Environment variable {key}={raw!r} is invalid: it must be a truth value such as 1/0 or true/false."
        ) from None


def parse_choice_from_env(key: str, default: str = "no") -> str:
    """The value of the variable ``key``, or ``default`` when it is unset."""
    return os.environ.get(key, str(default))


def are_libraries_initialized(*library_names: str) -> list[str]:
    """The names among ``library_names`` that have already been imported in this process.

    Example:
        >>> are_libraries_initialized("os", "a_library_nobody_imported")
        ['os']
    """
    return [name for name in library_names if name in sys.modules]


def convert_dict_to_env_variables(current_env: Mapping[str, str]) -> list[str]:
    """``KEY=value`` lines for the items that are safe to write to an environment file; others are warned about.

    An item is skipped (with a warning) when the key or value is empty or contains ``;``, a newline, ``<``,
    ``>`` or a space.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     convert_dict_to_env_variables({"A": "1", "BAD": "<x", "B": "2"})
        ['A=1\\n', 'B=2\\n']
    """
    lines = []
    for key, value in current_env.items():
        text = f"{key}{value}"
        if key and value and not any(char in text for char in _FORBIDDEN_ENV_CHARACTERS):
            lines.append(f"{key}={value}\n")
        else:
            warnings.warn(
                f"Skipping {key}={value!r}: environment entries must be non-empty and contain no ';', newline, "
                "'<', '>' or space.",
                UserWarning,
                stacklevel=2,
            )
    return lines


@contextmanager
def clear_environment() -> Iterator[None]:
    """Empty ``os.environ`` inside the block and restore it exactly (added keys removed) afterwards.

    Example:
        >>> import os
        >>> os.environ["LOCKSTEP_DOC_FOO"] = "bar"
        >>> with clear_environment():
        ...     "LOCKSTEP_DOC_FOO" in os.environ
        False
        >>> os.environ.pop("LOCKSTEP_DOC_FOO")
        'bar'
    """
    saved = os.environ.copy()
    os.environ.clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextmanager
def patch_environment(**kwargs: Any) -> Iterator[None]:
    """Set environment variables inside the block and restore the previous values afterwards.

    Keys are upper-cased and values converted with ``str``, as Accelerate does. A variable that did not
    exist before is removed again; one that did gets its old value back.

    Example:
        >>> import os
        >>> with patch_environment(lockstep_doc_bar=1):
        ...     os.environ["LOCKSTEP_DOC_BAR"]
        '1'
        >>> "LOCKSTEP_DOC_BAR" in os.environ
        False
    """
    with _env.patched({key.upper(): str(value) for key, value in kwargs.items()}):
        yield


def _own_variables() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if key.startswith(_OWN_PREFIXES)}


def _restore_own_variables(before: dict[str, str]) -> None:
    for key in set(_own_variables()) - set(before):
        os.environ.pop(key, None)
    os.environ.update(before)


def _purging(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        before = _own_variables()
        try:
            return function(*args, **kwargs)
        finally:
            _restore_own_variables(before)

    return wrapper


def purge_accelerate_environment(func_or_cls: T) -> T:
    """Undo the ``ACCELERATE_*`` and ``LOCKSTEP_*`` variables a function (or every test method of a class) sets.

    Decorate a test function or a test class so that settings one test leaves in the environment do not
    leak into the next. Variables that existed before get their values back; new ones are removed.

    Example:
        >>> import os
        >>> @purge_accelerate_environment
        ... def configure():
        ...     os.environ["ACCELERATE_MIXED_PRECISION"] = "fp16"
        >>> configure()
        >>> "ACCELERATE_MIXED_PRECISION" in os.environ
        False
    """
    if inspect.isclass(func_or_cls):
        for name, member in list(vars(func_or_cls).items()):
            if name.startswith("test") and callable(member):
                setattr(func_or_cls, name, _purging(member))
        for hook in ("setUp", "tearDown", "setup_method", "teardown_method"):
            member = vars(func_or_cls).get(hook)
            if callable(member):
                setattr(func_or_cls, hook, _purging(member))
        return func_or_cls
    if callable(func_or_cls):
        return _purging(func_or_cls)  # type: ignore[return-value]
    raise TypeError(
        f"purge_accelerate_environment() decorates a function or a class, got a {type(func_or_cls).__name__}."
    )


@dataclass
class CPUInformation:
    """This process's place among the CPU processes of a job, as its launcher described it."""

    rank: int = 0
    """Global rank of this process."""
    world_size: int = 1
    """Processes in the job."""
    local_rank: int = 0
    """Rank of this process on its machine."""
    local_world_size: int = 1
    """Processes on this machine."""


def get_cpu_distributed_information() -> CPUInformation:
    """Rank and sizes from the launcher's variables (torchrun, SLURM, Open MPI, MPICH / Intel MPI).

    Example:
        >>> with patch_environment(rank=1, world_size=2, local_rank=1, local_world_size=2):
        ...     get_cpu_distributed_information()
        CPUInformation(rank=1, world_size=2, local_rank=1, local_world_size=2)
    """
    cluster = _env.read_cluster_environment()
    return CPUInformation(
        rank=cluster.rank,
        world_size=cluster.world_size,
        local_rank=cluster.local_rank,
        local_world_size=cluster.local_world_size,
    )


# -- NVIDIA GPUs, asked without initializing CUDA ---------------------------------------------------------
def _nvidia_smi() -> str:
    found = shutil.which("nvidia-smi")
    if found is None and platform.system() == "Windows":
        drive = os.environ.get("systemdrive", "C:")
        return f"{drive}\\Program Files\\NVIDIA Corporation\\NVSMI\\nvidia-smi.exe"
    return found or "nvidia-smi"


def _query_gpus(field: str) -> list[str]:
    output = subprocess.check_output(
        [_nvidia_smi(), f"--query-gpu={field}", "--format=csv,noheader"], text=True, timeout=30
    )
    return [line.strip() for line in output.strip().splitlines() if line.strip()]


def get_gpu_info() -> tuple[list[str], int]:
    """The names and the number of NVIDIA GPUs, from ``nvidia-smi`` (CUDA is not initialized).

    Raises:
        FileNotFoundError: ``nvidia-smi`` is not installed.
        subprocess.CalledProcessError: ``nvidia-smi`` failed (e.g. no driver).
    """
    names = _query_gpus("name")
    return names, len(names)


def get_driver_version() -> str:
    """The NVIDIA driver's version (of the first GPU), from ``nvidia-smi``."""
    return _query_gpus("driver_version")[0]


def check_cuda_p2p_ib_support() -> bool:
    """False when several RTX 40-series GPUs run a driver older than 550.40.07 (their P2P/IB is broken).

    Anything else, including a machine without ``nvidia-smi``, is True, as in Accelerate.
    """
    try:
        names, count = get_gpu_info()
        if count > 1 and any("RTX 40" in name for name in names):
            return parse(get_driver_version()) >= parse("550.40.07")
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        pass
    return True


def check_fp8_capability() -> bool:
    """Whether the current CUDA GPU has FP8 units (compute capability >= 8.9); initializes CUDA."""
    import torch

    return torch.cuda.get_device_capability() >= (8, 9)


def check_cuda_fp8_capability() -> bool:
    """Whether the first CUDA GPU has FP8 units (compute capability >= 8.9: Ada, Hopper and later).

    Asks ``nvidia-smi`` first, so that CUDA stays uninitialized; falls back to torch. A machine without a
    CUDA GPU answers False.

    Example:
        >>> import torch
        >>> check_cuda_fp8_capability() if torch.cuda.is_available() else False
        False
    """
    try:
        first = _query_gpus("compute_cap")[0]
        return tuple(int(part) for part in first.split(".")) >= (8, 9)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        pass
    import torch

    if not torch.cuda.is_available() or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability() >= (8, 9)


# -- the device kind, asked without initializing a device ------------------------------------------------
_VENDOR_DEVICES = (
    ("mlu", "MULTI_MLU", "is_mlu_available"),
    ("sdaa", "MULTI_SDAA", "is_sdaa_available"),
    ("musa", "MULTI_MUSA", "is_musa_available"),
    ("npu", "MULTI_NPU", "is_npu_available"),
    ("hpu", "MULTI_HPU", "is_hpu_available"),
)


def get_current_device_type() -> tuple[str, str]:
    """The kind of accelerator this machine has and Accelerate's distributed type for several of them, e.g.
    ``("cuda", "MULTI_GPU")``, without initializing the device (safe before forking worker processes).

    Vendor plugins (MLU, SDAA, MUSA, NPU, HPU) come first, then CUDA (asked through NVML), then Intel XPUs;
    a machine with none of them answers ``("cpu", "MULTI_CPU")``. lockstep itself drives CPUs, CUDA and XPUs.

    Example:
        >>> import torch
        >>> get_current_device_type() if torch.cuda.is_available() else ("cpu", "MULTI_CPU")
        ('cpu', 'MULTI_CPU')
    """
    import torch

    from lockstep.utils import imports

    for device, distributed_type, probe in _VENDOR_DEVICES:
        if getattr(imports, probe)():
            return device, distributed_type
    # NVML answers without creating a CUDA context, which a forked child could not use.
    with patch_environment(PYTORCH_NVML_BASED_CUDA_CHECK="1"):
        if torch.cuda.is_available():
            return "cuda", "MULTI_GPU"
    if imports.is_xpu_available():
        return "xpu", "MULTI_XPU"
    return "cpu", "MULTI_CPU"


# -- NUMA affinity ------------------------------------------------------------------------------------------
@functools.lru_cache
def set_numa_affinity(local_process_index: int, verbose: bool | None = None) -> None:
    """Pin this process to the CPU cores closest to its CUDA GPU (number ``local_process_index``), as NVML
    reports them. Does nothing on a machine without CUDA GPUs, as in Accelerate; the result is cached, so a
    second call with the same arguments does nothing either.

    (``lockstep launch --enable-cpu-affinity`` also pins CPU-only workers, to equal shares of the cores.)

    Args:
        local_process_index: this process's GPU on the machine (its local rank).
        verbose: log the cores chosen; defaults to ``ACCELERATE_DEBUG_MODE``.

    Raises:
        ImportError: CUDA GPUs are present but ``pynvml`` (``pip install nvidia-ml-py``) is not.
        NotImplementedError: on ROCm GPUs (no NVML).

    Example:
        >>> set_numa_affinity(0)  # doctest: +SKIP
    """
    import torch

    if not torch.cuda.is_available():
        return
    if torch.version.hip is not None:
        raise NotImplementedError(
            "set_numa_affinity() on ROCm GPUs is not supported by lockstep: it reads the GPUs' CPU affinity "
            "through NVIDIA's NVML. Launch with `lockstep launch --enable-cpu-affinity` instead."
        )
    if verbose is None:
        verbose = parse_flag_from_env("ACCELERATE_DEBUG_MODE", False)
    cores = _nvml_cpu_affinity(local_process_index)
    os.sched_setaffinity(0, cores)
    if verbose:
        logging.getLogger(__name__).info(
            "Assigned %d CPU cores to process %d: %s", len(cores), local_process_index, cores
        )


def _nvml_cpu_affinity(gpu_index: int) -> list[int]:
    """The cores NVML names as closest to GPU ``gpu_index`` (its bitmask, 64 cores per word)."""
    try:
        import pynvml
    except ImportError:
        raise ImportError(
            "set_numa_affinity() on CUDA GPUs reads their CPU affinity through NVML, and pynvml is not "
            "installed: pip install nvidia-ml-py"
        ) from None
    pynvml.nvmlInit()
    words = math.ceil((os.cpu_count() or 1) / 64)
    handle = pynvml.nvmlDeviceGetHandleByIndex(gpu_index)
    mask = pynvml.nvmlDeviceGetCpuAffinity(handle, words)
    return [64 * word + bit for word, bits in enumerate(mask) for bit in range(64) if (bits >> bit) & 1]
