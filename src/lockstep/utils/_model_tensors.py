"""Sizes, tied weights, device maps and moving a model's tensors one by one (:mod:`lockstep.utils.modeling`).

Sizes are in bytes and read only shapes and dtypes, so models on the meta device work too.
"""

from __future__ import annotations

import inspect
import os
import warnings
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from lockstep.checkpoint.model_files import parse_size
from lockstep.config.kwargs import AutocastKwargs
from lockstep.state import AcceleratorState, PartialState
from lockstep.utils.dataclasses import CustomDtype

__all__ = [
    "calculate_maximum_sizes",
    "check_device_map",
    "check_tied_parameters_in_config",
    "check_tied_parameters_on_same_device",
    "compute_module_sizes",
    "compute_module_total_buffer_size",
    "convert_file_size_to_int",
    "dtype_byte_size",
    "find_tied_parameters",
    "get_grad_scaler",
    "get_max_layer_size",
    "get_max_memory",
    "get_mixed_precision_context_manager",
    "get_non_persistent_buffers",
    "id_tensor_storage",
    "named_module_tensors",
    "retie_parameters",
    "set_module_tensor_to_device",
]

_CUSTOM_DTYPE_BYTES = {CustomDtype.INT2: 1 / 4, CustomDtype.INT4: 1 / 2, CustomDtype.FP8: 1}
_KEEPS_DTYPE = ("torch.uint", "torch.int", "torch.bool")  # values that are never cast to another dtype


def as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``torch.float16`` from ``"float16"``, ``"torch.float16"`` or the dtype itself."""
    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"dtype {dtype!r} is not a torch dtype; pass e.g. torch.float16 or 'bfloat16'.")
    return found


def dtype_byte_size(dtype: torch.dtype | CustomDtype | str) -> float:
    """Bytes taken by one element of ``dtype`` (``bool`` counts as one bit, as in Accelerate).

    Example:
        >>> dtype_byte_size(torch.float32), dtype_byte_size(torch.bfloat16), dtype_byte_size(torch.bool)
        (4, 2, 0.125)
    """
    if isinstance(dtype, CustomDtype) or dtype in _CUSTOM_DTYPE_BYTES:
        return _CUSTOM_DTYPE_BYTES[CustomDtype(dtype)]
    dtype = as_dtype(dtype)
    if dtype == torch.bool:
        return 1 / 8
    return dtype.itemsize


def id_tensor_storage(tensor: torch.Tensor) -> tuple[torch.device, int, int]:
    """``(device, storage address, storage bytes)``: equal for tensors that share memory (meta: address 0).

    Example:
        >>> weight = torch.zeros(4)
        >>> id_tensor_storage(weight[:2]) == id_tensor_storage(weight)
        True
    """
    if tensor.device.type == "meta":
        return tensor.device, 0, tensor.nelement() * tensor.element_size()
    storage = tensor.untyped_storage()
    return tensor.device, storage.data_ptr(), storage.nbytes()


def get_non_persistent_buffers(module: nn.Module, recurse: bool = False) -> set[str]:
    """Names of the buffers left out of ``state_dict()`` (``persistent=False``), qualified when ``recurse``."""
    if not recurse:
        return set(module._non_persistent_buffers_set)
    return {
        f"{prefix}.{name}" if prefix else name
        for prefix, submodule in module.named_modules()
        for name in submodule._non_persistent_buffers_set
    }


def named_module_tensors(
    module: nn.Module,
    include_buffers: bool = True,
    recurse: bool = False,
    remove_non_persistent: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for the parameters, then the buffers, of ``module`` (of its submodules with ``recurse``).

    Args:
        module: the module.
        include_buffers: also yield buffers.
        recurse: include every submodule's tensors, with qualified names.
        remove_non_persistent: leave out buffers registered with ``persistent=False``.
    """
    yield from module.named_parameters(recurse=recurse)
    if include_buffers:
        skipped = get_non_persistent_buffers(module, recurse=recurse) if remove_non_persistent else set()
        for name, buffer in module.named_buffers(recurse=recurse):
            if name not in skipped:
                yield name, buffer


def compute_module_sizes(
    model: nn.Module,
    dtype: str | torch.dtype | None = None,
    special_dtypes: Mapping[str, str | torch.dtype] | None = None,
    buffers_only: bool = False,
) -> defaultdict[str, int]:
    """The bytes of every submodule (and of the whole model under ``""``), summed over its tensors.

    Args:
        model: the model; on the meta device too (only shapes and dtypes are read).
        dtype: count floating-point tensors as if loaded in this dtype (never larger than they are now).
        special_dtypes: per tensor name, a dtype that overrides ``dtype``.
        buffers_only: count only buffers.

    Returns:
        A ``defaultdict(int)`` from module name (``""``, ``"encoder"``, ``"encoder.layer.0"``, ...) and
        tensor name to bytes. Tied parameters count once, under their first name.
    """
    target = as_dtype(dtype) if dtype is not None else None
    special = {name: as_dtype(value) for name, value in (special_dtypes or {}).items()}
    tensors = model.named_buffers(recurse=True) if buffers_only else named_module_tensors(model, recurse=True)
    sizes: defaultdict[str, int] = defaultdict(int)
    for name, tensor in tensors:
        if name in special:
            per_element = dtype_byte_size(special[name])
        elif target is None or str(tensor.dtype).startswith(_KEEPS_DTYPE):
            per_element = dtype_byte_size(tensor.dtype)
        else:
            per_element = min(dtype_byte_size(target), dtype_byte_size(tensor.dtype))
        size = int(tensor.numel() * per_element)
        parts = name.split(".")
        for depth in range(len(parts) + 1):
            sizes[".".join(parts[:depth])] += size
    return sizes


def compute_module_total_buffer_size(
    model: nn.Module,
    dtype: str | torch.dtype | None = None,
    special_dtypes: Mapping[str, str | torch.dtype] | None = None,
) -> int:
    """The bytes of all of ``model``'s buffers."""
    return compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes, buffers_only=True).get(
        "", 0
    )


def get_max_layer_size(
    modules: Sequence[tuple[str, nn.Module]],
    module_sizes: Mapping[str, int],
    no_split_module_classes: Sequence[str],
) -> tuple[int, list[str]]:
    """The size of the largest layer among ``modules``, and the names of the layers of that size.

    A layer is a module without children, or one whose class name is in ``no_split_module_classes``;
    other modules are opened up into their children.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 8)))
        >>> get_max_layer_size(list(model.named_children()), compute_module_sizes(model), [])
        (160, ['1.0'])
    """
    largest, names = 0, []
    pending = list(modules)
    while pending:
        name, module = pending.pop(0)
        children = list(module.named_children()) if isinstance(module, nn.Module) else []
        if not children or type(module).__name__ in no_split_module_classes:
            size = module_sizes[name]
            if size > largest:
                largest, names = size, [name]
            elif size == largest:
                names.append(name)
        else:
            pending = [(f"{name}.{child}", submodule) for child, submodule in children] + pending
    return largest, names


def calculate_maximum_sizes(model: nn.Module) -> tuple[int, tuple[int, list[str]]]:
    """``(total bytes, (bytes of the largest layer, its names))``; ``model._no_split_modules`` are layers.

    Example:
        >>> calculate_maximum_sizes(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 8)))
        (240, (160, ['1']))
    """
    sizes = compute_module_sizes(model)
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    modules = [
        *model.named_parameters(recurse=False),
        *model.named_children(),
        *model.named_buffers(recurse=False),
    ]
    return sizes[""], get_max_layer_size(modules, sizes, no_split)


def find_tied_parameters(model: nn.Module, **kwargs: Any) -> list[list[str]]:
    """Groups of parameter names that are the same ``nn.Parameter`` object, each group sorted.

    Groups are listed in the order their first name appears in ``model.named_parameters()``.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        >>> find_tied_parameters(model)
        []
    """
    names_of: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(parameter), []).append(name)
    return [sorted(names) for names in names_of.values() if len(names) > 1]


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The submodule holding the tensor ``name`` (``"encoder.layer.0.weight"``) and the tensor's own name."""
    *path, leaf = name.split(".")
    module = model
    for index, part in enumerate(path):
        child = getattr(module, part, None)
        if not isinstance(child, nn.Module):
            raise ValueError(
                f"{type(model).__name__} has no submodule {'.'.join(path[: index + 1])!r} (looking up "
                f"{name!r}). Pass a name from model.named_parameters() or model.named_buffers()."
            )
        module = child
    return module, leaf


def retie_parameters(model: nn.Module, tied_params: Sequence[Sequence[str]]) -> None:
    """Make every name of each group (from :func:`find_tied_parameters`) point at one parameter again.

    The group's first parameter that is not on the meta device is shared by all its names; a group whose
    parameters are all on the meta device is left as it is.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2, bias=False), torch.nn.Linear(2, 2, bias=False))
        >>> retie_parameters(model, [["0.weight", "1.weight"]])
        >>> model[0].weight is model[1].weight
        True
    """
    for group in tied_params:
        owners = [_owner(model, name) for name in group]
        shared = next(
            (getattr(m, leaf) for m, leaf in owners if getattr(m, leaf).device.type != "meta"), None
        )
        if shared is None:
            continue
        for module, leaf in owners:
            setattr(module, leaf, shared)


def check_tied_parameters_in_config(model: nn.Module) -> bool:
    """Whether a transformers model's config or modules say some weights should be tied."""
    if "PreTrainedModel" not in [cls.__name__ for cls in inspect.getmro(type(model))]:
        return False
    config = getattr(model, "config", None)
    word_embeddings = bool(
        getattr(config, "tie_word_embeddings", False)
        and callable(getattr(model, "get_output_embeddings", None))
        and model.get_output_embeddings() is not None
    )
    encoder_decoder = bool(
        getattr(config, "is_encoder_decoder", False) and getattr(config, "tie_encoder_decoder", False)
    )
    return word_embeddings or encoder_decoder or any(hasattr(m, "_tie_weights") for m in model.modules())


_NO_DEFAULT: Any = object()


def device_for(name: str, device_map: Mapping[str, Any], default: Any = _NO_DEFAULT) -> Any:
    """The device ``device_map`` gives the tensor or module ``name`` (its longest mapped prefix)."""
    parts = name.split(".")
    for depth in range(len(parts), -1, -1):
        prefix = ".".join(parts[:depth])
        if prefix in device_map:
            return device_map[prefix]
    if default is not _NO_DEFAULT:
        return default
    raise ValueError(f"device_map gives no device for {name!r}; add it or one of the modules holding it.")


def torch_device(device: int | str | torch.device) -> torch.device:
    """A ``torch.device``; an int is an accelerator index (XPU where XPUs are the accelerator, else CUDA)."""
    if not isinstance(device, int) or isinstance(device, bool):
        return torch.device(device)
    xpu = getattr(torch, "xpu", None)
    if not torch.cuda.is_available() and xpu is not None and xpu.is_available():
        return torch.device("xpu", device)
    return torch.device("cuda", device)


def check_tied_parameters_on_same_device(
    tied_params: Sequence[Sequence[str]], device_map: Mapping[str, Any]
) -> None:
    """Warn about tied parameters that ``device_map`` places on different devices."""
    for group in tied_params:
        devices = {name: device_for(name, device_map) for name in group}
        if len({str(device) for device in devices.values()}) > 1:
            warnings.warn(
                f"Tied parameters are on different devices: {devices}. Put the modules holding them on one "
                "device in the device_map.",
                UserWarning,
                stacklevel=2,
            )


def check_device_map(model: nn.Module, device_map: Mapping[str, Any]) -> None:
    """Raise when ``device_map`` gives no device to some tensor of ``model``'s state dict.

    Example:
        >>> check_device_map(torch.nn.Linear(2, 2), {"": "cpu"})
    """
    if "" in device_map:
        return
    uncovered = [
        name
        for name in model.state_dict()
        if not any(name == key or name.startswith(f"{key}.") for key in device_map)
    ]
    if uncovered:
        raise ValueError(
            f"The device_map gives no device to these tensors: {', '.join(uncovered)}. Map them, or one of "
            'the modules holding them ("" maps the whole model).'
        )


def convert_file_size_to_int(size: int | str) -> int:
    """Bytes from an int or a string such as ``"5GB"`` (10**9), ``"5GiB"`` (2**30) or ``"5Gb"`` (gigabits).

    Example:
        >>> convert_file_size_to_int("1MiB"), convert_file_size_to_int("2KB")
        (1048576, 2000)
    """
    try:
        return parse_size(size)
    except (TypeError, ValueError):
        raise ValueError(
            f"convert_file_size_to_int({size!r}) is not a size: pass a positive number of bytes or a string "
            "such as '5GB', '500MB' or '1.5GiB'."
        ) from None


def _cpu_available_memory() -> int:
    try:
        import psutil
    except ImportError:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(psutil.virtual_memory().available)


def get_max_memory(max_memory: Mapping[int | str, int | str] | None = None) -> dict[int | str, int]:
    """Bytes usable on each device: the GPUs' free memory (keys 0, 1, ...) and the CPU's available RAM.

    Args:
        max_memory: a mapping to check and convert instead (values such as ``"10GiB"`` become bytes).

    Example:
        >>> get_max_memory({"cpu": "1GB"})
        {'cpu': 1000000000}
    """
    if max_memory is None:
        found: dict[int | str, int] = {}
        if torch.cuda.is_available():
            found.update(
                {index: torch.cuda.mem_get_info(index)[0] for index in range(torch.cuda.device_count())}
            )
        elif hasattr(torch, "xpu") and torch.xpu.is_available():
            found.update(
                {index: torch.xpu.mem_get_info(index)[0] for index in range(torch.xpu.device_count())}
            )
        found["cpu"] = _cpu_available_memory()
        return found
    result: dict[int | str, int] = {}
    for key, value in max_memory.items():
        if not isinstance(key, int) and key not in ("cpu", "mps", "disk"):
            raise ValueError(
                f"get_max_memory() got device {key!r}: use GPU indices (0, 1, ...), 'mps', 'cpu' or 'disk'."
            )
        result[key] = convert_file_size_to_int(value) if isinstance(value, str) else int(value)
    return result


def get_mixed_precision_context_manager(
    native_amp: bool = False, autocast_kwargs: AutocastKwargs | None = None
) -> AbstractContextManager[Any]:
    """``torch.autocast`` for the Accelerator's ``mixed_precision`` on this process's device, when ``native_amp``.

    Without ``native_amp``, or with ``mixed_precision="no"``, a context that does nothing.

    Example:
        >>> with get_mixed_precision_context_manager(native_amp=False):
        ...     pass
    """
    autocast_kwargs = autocast_kwargs or AutocastKwargs()
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(str(AcceleratorState().mixed_precision))
    if not native_amp or dtype is None or not autocast_kwargs.enabled:
        return nullcontext()
    kwargs: dict[str, Any] = {"dtype": dtype}
    if autocast_kwargs.cache_enabled is not None:
        kwargs["cache_enabled"] = autocast_kwargs.cache_enabled
    return torch.autocast(device_type=PartialState().device.type, **kwargs)


def get_grad_scaler(distributed_type: Any = None, **kwargs: Any) -> torch.amp.GradScaler:
    """A ``torch.amp.GradScaler`` for this process's device (``kwargs`` go to its constructor).

    ``distributed_type`` is accepted for Accelerate's signature: FSDP2's sharded parameters need no special
    scaler, so every distributed type gets the same one.
    """
    return torch.amp.GradScaler(PartialState().device.type, **kwargs)


def set_module_tensor_to_device(
    module: nn.Module,
    tensor_name: str,
    device: int | str | torch.device,
    value: torch.Tensor | None = None,
    dtype: str | torch.dtype | None = None,
    fp16_statistics: torch.Tensor | None = None,
    tied_params_map: dict[int, dict[Any, torch.Tensor]] | None = None,
    non_blocking: bool = False,
    clear_cache: bool = True,
) -> None:
    """Put the parameter or buffer ``tensor_name`` of ``module`` on ``device``, optionally with a new ``value``.

    Unlike ``param.to(device)``, the module itself is updated; a parameter stays an ``nn.Parameter`` of its
    class with its ``requires_grad``.

    Args:
        module: the module holding the tensor.
        tensor_name: its qualified name, e.g. ``"encoder.layer.0.weight"``.
        device: where to put it (an int is a CUDA index).
        value: new contents, of the same shape (needed to leave the meta device).
        dtype: cast ``value`` to this dtype (integer and bool values are never cast); without it, ``value``
            takes the current tensor's dtype, as ``load_state_dict`` does.
        fp16_statistics: bitsandbytes 8-bit statistics; not supported (must be None).
        tied_params_map: ``{data_ptr: {device: tensor}}`` of tied weights already placed: a weight found
            there is reused instead of copied, and newly placed ones are recorded.
        non_blocking: ask for an asynchronous copy.
        clear_cache: empty the accelerator's cache after moving to a non-CPU device.

    Raises:
        ValueError: the name is unknown, the shape differs, or a meta tensor is moved without a ``value``.
        NotImplementedError: ``fp16_statistics`` is given.

    Example:
        >>> with torch.device("meta"):
        ...     layer = torch.nn.Linear(2, 2)
        >>> set_module_tensor_to_device(layer, "weight", "cpu", value=torch.ones(2, 2, dtype=torch.float64))
        >>> layer.weight.dtype, layer.weight.device, type(layer.weight).__name__
        (torch.float32, device(type='cpu'), 'Parameter')
    """
    if fp16_statistics is not None:
        raise NotImplementedError(
            "set_module_tensor_to_device(fp16_statistics=...) sets bitsandbytes 8-bit statistics, which lockstep "
            "does not support: lockstep does not integrate bitsandbytes. Pass fp16_statistics=None."
        )
    owner, leaf = _owner(module, tensor_name)
    if leaf not in owner._parameters and leaf not in owner._buffers:
        raise ValueError(
            f"{type(owner).__name__} has no parameter or buffer {leaf!r} (looking up {tensor_name!r}); it has "
            f"{sorted([*owner._parameters, *owner._buffers])}."
        )
    old = getattr(owner, leaf)
    target = torch_device(device)
    reused = _tied_copy(tied_params_map, value if value is not None else old, target)
    if reused is not None:
        owner._parameters[leaf] = reused  # type: ignore[assignment]
        return
    new = _new_value(tensor_name, old, value, dtype, target, non_blocking)
    if leaf in owner._buffers:
        owner._buffers[leaf] = new
    else:
        parameter_class = type(owner._parameters[leaf])
        new = parameter_class(new, requires_grad=old.requires_grad)
        owner._parameters[leaf] = new
    if clear_cache and target.type != "cpu":
        from lockstep.memory import clear_device_cache

        clear_device_cache()
    if tied_params_map is not None:
        for source in (old, value):
            if source is not None and source.data_ptr() in tied_params_map:
                tied_params_map[source.data_ptr()].setdefault(target, new)


def _tied_copy(
    tied_params_map: dict[int, dict[Any, torch.Tensor]] | None, source: torch.Tensor, target: torch.device
) -> torch.Tensor | None:
    if tied_params_map is None:
        return None
    return tied_params_map.get(source.data_ptr(), {}).get(target)


def _new_value(
    name: str,
    old: torch.Tensor,
    value: torch.Tensor | None,
    dtype: str | torch.dtype | None,
    target: torch.device,
    non_blocking: bool,
) -> torch.Tensor:
    if value is None:
        if old.device.type == "meta" and target.type != "meta":
            raise ValueError(
                f"{name} is on the meta device and has no data to move to {target}; pass value=... with its "
                "contents."
            )
        new = old.detach().to(target, non_blocking=non_blocking)
        if dtype is not None and target.type == "meta" and not str(old.dtype).startswith(_KEEPS_DTYPE):
            new = new.to(as_dtype(dtype))
        return new
    value = value if isinstance(value, torch.Tensor) else torch.tensor(value)
    if value.shape != old.shape:
        raise ValueError(
            f"Cannot set {name} (shape {tuple(old.shape)}) to a tensor of shape {tuple(value.shape)}: the "
            "shapes differ. Check that the checkpoint belongs to this model."
        )
    if dtype is None:
        value = value.to(old.dtype)
    elif not str(value.dtype).startswith(_KEEPS_DTYPE):
        value = value.to(as_dtype(dtype))
    with torch.no_grad():
        return value.detach().to(target, non_blocking=non_blocking)
