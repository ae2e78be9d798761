"""``accelerate.utils.other``: unwrapping models, saving and loading on the right process, and small helpers.

:func:`load` keeps lockstep's safety: ``torch.load(weights_only=True)`` unless the caller passes
``weights_only=False`` for a file it trusts (plain NumPy arrays are allowed, as in Accelerate).

Example:
    >>> convert_bytes(1536), merge_dicts({"a": {"b": 1}}, {"a": {"c": 2}})
    ('1.5 KB', {'a': {'c': 2, 'b': 1}})
    >>> import torch
    >>> save({"step": torch.tensor(3)}, "state.pt")
    >>> load("state.pt")
    {'step': tensor(3)}
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import platform
import re
import socket
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import torch
from packaging.version import Version
from torch import nn

from lockstep.backends.wrappers import module_wrappers
from lockstep.config.file import ClusterConfig, default_config_path, save_config_file
from lockstep.errors import UnsafeCheckpointError
from lockstep.integrations.regional_compilation import (
    compile_regions,
    compile_regions_in_place,
    is_compiled_in_place,
)
from lockstep.precision import parse_mixed_precision, remove_forward_wrapper
from lockstep.state import PartialState
from lockstep.utils._model_tensors import id_tensor_storage

__all__ = [
    "check_os_kernel",
    "clean_state_dict_for_safetensors",
    "compile_regions",
    "compile_regions_deepspeed",
    "compile_regions_fsdp2",
    "convert_bytes",
    "extract_model_from_parallel",
    "get_free_port",
    "get_model_tp_size",
    "get_module_children_bottom_up",
    "get_pretty_name",
    "has_compiled_regions",
    "is_compiled_module",
    "is_peft_model",
    "is_port_in_use",
    "load",
    "merge_dicts",
    "model_has_dtensor",
    "recursive_getattr",
    "save",
    "wait_for_everyone",
    "write_basic_config",
]

_logger = logging.getLogger(__name__)
_MIN_KERNEL = "5.5.0"  # older Linux kernels can hang multi-process jobs (huggingface/accelerate#1929)
FileLike = str | os.PathLike[str] | IO[bytes]


# -- models --------------------------------------------------------------------------------------------
def is_compiled_module(module: Any) -> bool:
    """Whether ``module`` is the wrapper ``torch.compile`` returns for a module."""
    dynamo = getattr(torch, "_dynamo", None)
    return dynamo is not None and isinstance(module, dynamo.eval_frame.OptimizedModule)


def has_compiled_regions(module: nn.Module) -> bool:
    """Whether ``module`` (having children) or one of its submodules was compiled: wrapped by
    ``torch.compile`` as in Accelerate, or compiled in place with ``nn.Module.compile`` (how lockstep
    applies ``TorchDynamoPlugin(use_regional_compilation=True)``).

    Example:
        >>> model = nn.Sequential(nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]))
        >>> has_compiled_regions(model), has_compiled_regions(compile_regions(model, backend="eager"))
        (False, True)
    """
    if not module._modules:
        return False
    return any(is_compiled_module(sub) or is_compiled_in_place(sub) for sub in module.modules())


def compile_regions_fsdp2(module: nn.Module, **compile_kwargs: Any) -> nn.Module:
    """Regional compilation in place (``nn.Module.compile`` on each repeated block and the modules beside
    them), so that FSDP2's hooks, added by ``fully_shard`` before or after, keep running; returns ``module``.
    See :func:`compile_regions` for which modules are compiled.

    Example:
        >>> model = nn.Sequential(nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]))
        >>> compile_regions_fsdp2(model, backend="eager") is model, has_compiled_regions(model)
        (True, True)
    """
    return compile_regions_in_place(module, **compile_kwargs)


def compile_regions_deepspeed(module: nn.Module, **compile_kwargs: Any) -> None:
    """Regional compilation in place, as Accelerate applies it to a ``DeepSpeedEngine``'s module; it needs no
    DeepSpeed and works on any module (returns None, as in Accelerate)."""
    compile_regions_in_place(module, **compile_kwargs)


def model_has_dtensor(model: nn.Module) -> bool:
    """Whether a parameter of ``model`` is a ``DTensor`` (sharded by FSDP2 or tensor parallelism).

    Example:
        >>> model_has_dtensor(nn.Linear(2, 2))
        False
    """
    from torch.distributed.tensor import DTensor

    return any(isinstance(param, DTensor) for param in model.parameters())


def get_model_tp_size(model: nn.Module) -> int | None:
    """The tensor-parallel degree transformers loaded ``model`` with, or None when it was not.

    transformers < 5 records it as ``model.tp_size``; transformers >= 5 in
    ``model.config.distributed_config`` (an object or, after a round trip through JSON, a dict).

    Example:
        >>> model = nn.Linear(2, 2)
        >>> get_model_tp_size(model)
        >>> model.tp_size = 2
        >>> get_model_tp_size(model)
        2
    """
    size = getattr(model, "tp_size", None)
    if size is not None:
        return size
    distributed = getattr(getattr(model, "config", None), "distributed_config", None)
    if isinstance(distributed, Mapping):
        return distributed.get("tp_size")
    return getattr(distributed, "tp_size", None)


def _regionally_compiled_original(model: nn.Module) -> nn.Module | None:
    """The model ``compile_regions`` copied ``model`` from (kept as a plain attribute), if it did."""
    original = model.__dict__.get("_orig_mod")
    return original if isinstance(original, nn.Module) else None


def _strip(model: nn.Module, wrappers: tuple[type, ...]) -> tuple[nn.Module, nn.Module | None]:
    """``model`` without distributed and compile wrappers, and the outermost compile wrapper met (a
    ``torch.compile`` wrapper, or a module ``compile_regions`` returned)."""
    compiled = None
    while True:
        if isinstance(model, wrappers):
            model = model.module
        elif is_compiled_module(model):
            compiled = compiled if compiled is not None else model
            model = model._orig_mod
        elif (original := _regionally_compiled_original(model)) is not None:
            compiled = compiled if compiled is not None else model
            model = original
        else:
            return model, compiled


def _unwrap_children(module: nn.Module, wrappers: tuple[type, ...]) -> None:
    for name, child in list(module.named_children()):
        inner, _ = _strip(child, wrappers)
        if inner is not child:
            setattr(module, name, inner)
        _unwrap_children(inner, wrappers)


def extract_model_from_parallel(
    model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True, recursive: bool = False
) -> nn.Module:
    """The user's module inside DDP, ``DataParallel``, FSDP1 and ``torch.compile`` wrappers.

    Args:
        model: a wrapped (or plain) module. FSDP2 shards modules in place, so there is nothing to strip.
        keep_fp32_wrapper: keep the mixed-precision forward wrapper ``prepare`` installed; False removes it
            (from the model itself).
        keep_torch_compile: return the compiled module around the unwrapped model (a new wrapper when the
            compiled module wrapped a distributed one; the training model is left as it is).
        recursive: also replace wrapped submodules by their inner modules (this changes ``model``).

    Example:
        >>> import torch
        >>> inner = torch.nn.Linear(2, 2)
        >>> extract_model_from_parallel(torch.nn.DataParallel(inner)) is inner
        True
    """
    wrappers = module_wrappers()
    inner, compiled = _strip(model, wrappers)
    if recursive:
        _unwrap_children(inner, wrappers)
    if not keep_fp32_wrapper:
        remove_forward_wrapper(inner)
    if not keep_torch_compile or compiled is None:
        return inner
    if compiled._orig_mod is inner or not is_compiled_module(compiled):
        return compiled
    return type(compiled)(inner, compiled.dynamo_ctx)


def is_peft_model(model: nn.Module) -> bool:
    """Whether ``model``, unwrapped from DDP and ``torch.compile``, is a ``peft.PeftModel`` (peft is not
    imported: a peft model exists only where its user imported peft)."""
    from lockstep.integrations.peft import is_peft_model as is_peft

    return is_peft(extract_model_from_parallel(model))


def get_module_children_bottom_up(model: nn.Module, return_fqns: bool = False) -> list[Any]:
    """Every submodule of ``model``, children before their parents, ``model`` itself last.

    Args:
        model: the module.
        return_fqns: return ``(qualified name, module)`` pairs (``""`` for ``model``).

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.Sequential(torch.nn.ReLU()))
        >>> [name for name, _ in get_module_children_bottom_up(model, return_fqns=True)]
        ['0', '1.0', '1', '']
    """
    stack: list[tuple[str, nn.Module]] = [("", model)]
    ordered: list[tuple[str, nn.Module]] = []
    while stack:
        name, module = stack.pop()
        ordered.append((name, module))
        stack.extend((f"{name}.{child}" if name else child, sub) for child, sub in module.named_children())
    ordered.reverse()
    return ordered if return_fqns else [module for _, module in ordered]


# -- saving and loading --------------------------------------------------------------------------------
def wait_for_everyone() -> None:
    """A barrier: every process waits here until all have arrived (nothing to wait for with one process)."""
    PartialState().wait_for_everyone()


def clean_state_dict_for_safetensors(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Drop the extra names of tensors sharing memory (keeping the first) and make tensors contiguous.

    safetensors refuses tensors that share storage, such as tied embeddings; the dropped names are logged.

    Example:
        >>> import torch
        >>> weight = torch.ones(2)
        >>> sorted(clean_state_dict_for_safetensors({"embed": weight, "head": weight, "bias": torch.zeros(1)}))
        ['bias', 'embed']
    """
    first_name: dict[tuple[torch.device, int, int], str] = {}
    dropped = []
    cleaned: dict[str, Any] = {}
    for name, value in state_dict.items():
        if isinstance(value, torch.Tensor):
            storage = id_tensor_storage(value)
            if storage[1] != 0 and storage in first_name:
                dropped.append(name)
                continue
            first_name.setdefault(storage, name)
            value = value.contiguous()
        cleaned[name] = value
    if dropped:
        _logger.warning(
            "Removed shared tensors %s while saving: they share memory with other entries.", dropped
        )
    return cleaned


def _write(f: FileLike, write: Callable[[Any], None]) -> None:
    """Write through a temporary file renamed over ``f`` (a path), or straight into a file object."""
    if not isinstance(f, (str, os.PathLike)):
        write(f)
        return
    path = Path(f)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        write(temporary)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def _safetensors_writer(obj: Any) -> Callable[[Any], None]:
    from safetensors.torch import save as to_bytes
    from safetensors.torch import save_file

    if not isinstance(obj, Mapping) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()
    ):
        raise TypeError(
            f"save(safe_serialization=True) stores a dict of str -> tensor, got a {type(obj).__name__}. Pass a "
            "state dict, or safe_serialization=False for other objects."
        )
    tensors = clean_state_dict_for_safetensors(obj)
    metadata = {"format": "pt"}

    def write(target: Any) -> None:
        if isinstance(target, (str, os.PathLike)):
            save_file(tensors, target, metadata=metadata)
        else:
            target.write(to_bytes(tensors, metadata=metadata))

    return write


def save(obj: Any, f: FileLike, save_on_each_node: bool = False, safe_serialization: bool = False) -> None:
    """Save ``obj`` on the main process only (or on each machine's local main process): use instead of ``torch.save``.

    A path is written atomically (a temporary file renamed into place).

    Args:
        obj: what to save.
        f: a path or a binary file object.
        save_on_each_node: write on the local main process of every machine instead of once.
        safe_serialization: write safetensors (``obj`` must map str to tensors; tensors sharing memory are
            stored once) instead of ``torch.save``'s pickle.

    Example:
        >>> import torch
        >>> save({"w": torch.ones(2)}, "w.safetensors", safe_serialization=True)
    """
    state = PartialState()
    if not (state.is_local_main_process if save_on_each_node else state.is_main_process):
        return
    if safe_serialization:
        _write(f, _safetensors_writer(obj))
    else:
        _write(f, functools.partial(torch.save, obj))


def _numpy_array_globals() -> list[Any]:
    """What unpickling plain NumPy arrays needs, the globals Accelerate's ``load`` allows."""
    import codecs

    import numpy as np

    core = np._core if hasattr(np, "_core") else np.core  # NumPy 2 renamed np.core
    allowed: list[Any] = [core.multiarray._reconstruct, np.ndarray, np.dtype, codecs.encode]
    if hasattr(np, "dtypes"):
        allowed += [type(np.dtype(kind)) for kind in ("uint32", "int64", "float32", "float64")]
    return allowed


def load(f: FileLike, map_location: Any = None, **kwargs: Any) -> Any:
    """``torch.load`` with ``weights_only=True`` unless ``weights_only=False`` is passed.

    Tensors, numbers, strings, containers of them and plain NumPy arrays load; anything else is refused
    without being run.

    Args:
        f: a path or a binary file object.
        map_location: where tensors go (a device, a string, a dict or a function, as for ``torch.load``).
        **kwargs: more ``torch.load`` arguments; ``weights_only=False`` unpickles arbitrary objects (only
            for files you trust).

    Raises:
        UnsafeCheckpointError: the file holds objects ``weights_only`` loading refuses.

    Example:
        >>> import torch
        >>> torch.save({"lr": 0.1}, "opt.pt")
        >>> load("opt.pt", map_location="cpu")
        {'lr': 0.1}
    """
    if not kwargs.pop("weights_only", True):
        return torch.load(f, map_location=map_location, weights_only=False, **kwargs)
    try:
        with torch.serialization.safe_globals(_numpy_array_globals()):
            return torch.load(f, map_location=map_location, weights_only=True, **kwargs)
    except pickle.UnpicklingError as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        name = f if isinstance(f, (str, os.PathLike)) else getattr(f, "name", "the file")
        raise UnsafeCheckpointError(
            f"load({str(name)!r}) refused to unpickle objects that weights_only loading does not allow "
            f"({reason}). Pass weights_only=False only if you trust the file."
        ) from None


# -- the config file -----------------------------------------------------------------------------------
def write_basic_config(
    mixed_precision: str = "no", save_location: str | os.PathLike[str] | None = None
) -> Path | bool:
    """Write a config file for this machine: every GPU (one process each), else one CPU process.

    With several GPUs the file says ``MULTI_GPU`` with one process per GPU, with one GPU ``NO``; without a
    GPU ``NO`` on the CPU (``use_cpu: true``), as Accelerate writes it. An existing file is left alone.

    Args:
        mixed_precision: ``"no"``, ``"fp16"`` or ``"bf16"``.
        save_location: where to write; the file ``lockstep launch`` reads by default when omitted
            (``$LOCKSTEP_HOME/default_config.yaml``, see :func:`lockstep.config.file.default_config_path`).

    Returns:
        The path written, or ``False`` when a file already exists there (a message says so).

    Example:
        >>> write_basic_config(mixed_precision="bf16", save_location="cfg/default_config.yaml")  # doctest: +SKIP
        PosixPath('cfg/default_config.yaml')
    """
    path = Path(save_location) if save_location is not None else default_config_path()
    if path.exists():
        print(
            f"Configuration already exists at {path}, will not override. Run `lockstep config` or pass another "
            "save_location."
        )
        return False
    precision = parse_mixed_precision(mixed_precision)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    config = ClusterConfig(
        distributed_type="MULTI_GPU" if gpus > 1 else "NO",
        num_processes=max(gpus, 1),
        use_cpu=gpus == 0,
        mixed_precision=precision,
    )
    return save_config_file(config, path)


# -- small helpers ---------------------------------------------------------------------------------------
def convert_bytes(size: float) -> str:
    """``size`` bytes in the largest unit that keeps it at least 1 (powers of 1024), rounded to 2 decimals.

    Example:
        >>> convert_bytes(512), convert_bytes(3 * 1024**3)
        ('512 bytes', '3.0 GB')
    """
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if size < 1024.0:
            return f"{round(size, 2)} {unit}"
        size /= 1024.0
    return f"{round(size, 2)} PB"


def get_pretty_name(obj: Any) -> str:
    """The qualified name of a class or function, or of an object's class.

    Example:
        >>> get_pretty_name(3), get_pretty_name(dict.get)
        ('int', 'dict.get')
    """
    if not hasattr(obj, "__qualname__") and not hasattr(obj, "__name__"):
        obj = getattr(obj, "__class__", obj)
    return getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or str(obj)


def merge_dicts(source: Mapping[str, Any], destination: dict[str, Any]) -> dict[str, Any]:
    """Merge ``source`` into ``destination`` recursively (nested dicts are merged, other values replaced)."""
    for key, value in source.items():
        if isinstance(value, Mapping):
            node = destination.setdefault(key, {})
            merge_dicts(value, node)
        else:
            destination[key] = value
    return destination


def recursive_getattr(obj: Any, attr: str) -> Any:
    """``getattr`` along a dotted path, e.g. ``recursive_getattr(model, "encoder.layer")``."""
    return functools.reduce(getattr, attr.split("."), obj)


def is_port_in_use(port: int | None = None) -> bool:
    """Whether something listens on ``port`` (default 29500, the rendezvous port) on localhost."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex(("localhost", 29500 if port is None else port)) == 0


def get_free_port() -> int:
    """A TCP port on localhost that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def check_os_kernel() -> None:
    """Log a warning on Linux kernels older than 5.5.0, which can make multi-process jobs hang."""
    info = platform.uname()
    if info.system != "Linux":
        return
    match = re.search(r"(\d+\.\d+\.\d+)", info.release)
    if match is not None and Version(match.group(1)) < Version(_MIN_KERNEL):
        _logger.warning(
            "Detected kernel version %s, which is below the recommended minimum of %s; this can cause the "
            "process to hang. Upgrade the kernel to %s or later.",
            match.group(1),
            _MIN_KERNEL,
            _MIN_KERNEL,
        )
