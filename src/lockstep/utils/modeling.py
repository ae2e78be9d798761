"""``accelerate.utils.modeling``: sizes, tied weights, and moving or loading a model's tensors one by one.

Sizes are in bytes and read only shapes and dtypes (models on the meta device work too). The loaders read
safetensors and ``.bin`` files, ``.bin`` only with ``torch.load(weights_only=True)``. Weights offloaded to
disk (:mod:`lockstep.utils.offload`'s folders) load back with :func:`load_offloaded_weights`;
:func:`align_module_device` moves a module's own tensors for the length of a ``with`` block.
:func:`infer_auto_device_map` plans where each block of a model goes under a memory budget (GPUs, then
the CPU, then the disk) and :func:`get_balanced_memory` spreads a model evenly over several GPUs; the plan
is what :func:`lockstep.dispatch_model` and :func:`lockstep.load_checkpoint_and_dispatch` follow.
bitsandbytes' 8-bit statistics are not supported.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    >>> model[1].weight = model[0].weight
    >>> find_tied_parameters(model)
    [['0.weight', '1.weight']]
    >>> sizes = compute_module_sizes(model)
    >>> sizes[""], sizes["0"], sizes["1"]  # the tied weight counts once, under its first name
    (96, 80, 16)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from lockstep.utils._device_map import get_balanced_memory, infer_auto_device_map
from lockstep.utils._loading import load_checkpoint_in_model, load_state_dict
from lockstep.utils._model_tensors import (
    calculate_maximum_sizes,
    check_device_map,
    check_tied_parameters_in_config,
    check_tied_parameters_on_same_device,
    compute_module_sizes,
    compute_module_total_buffer_size,
    convert_file_size_to_int,
    dtype_byte_size,
    find_tied_parameters,
    get_grad_scaler,
    get_max_layer_size,
    get_max_memory,
    get_mixed_precision_context_manager,
    get_non_persistent_buffers,
    id_tensor_storage,
    named_module_tensors,
    retie_parameters,
    set_module_tensor_to_device,
)
from lockstep.utils.offload import load_offloaded_weight
from lockstep.utils.other import is_peft_model

__all__ = [
    "align_module_device",
    "calculate_maximum_sizes",
    "check_device_map",
    "check_tied_parameters_in_config",
    "check_tied_parameters_on_same_device",
    "compute_module_sizes",
    "compute_module_total_buffer_size",
    "convert_file_size_to_int",
    "dtype_byte_size",
    "find_tied_parameters",
    "get_balanced_memory",
    "get_grad_scaler",
    "get_max_layer_size",
    "get_max_memory",
    "get_mixed_precision_context_manager",
    "get_non_persistent_buffers",
    "has_offloaded_params",
    "id_tensor_storage",
    "infer_auto_device_map",
    "is_peft_model",
    "load_checkpoint_in_model",
    "load_offloaded_weights",
    "load_state_dict",
    "named_module_tensors",
    "retie_parameters",
    "set_module_tensor_to_device",
]


def load_offloaded_weights(
    model: nn.Module, index: Mapping[str, Any] | None, offload_folder: str | os.PathLike[str]
) -> None:
    """Load the weights an offload folder holds (``offload_state_dict``'s layout) into ``model``, on the CPU.

    Args:
        model: the module to fill (it may be on the meta device).
        index: the folder's index (``{name: {"dtype", "shape"}}``); nothing happens when it is empty.
        offload_folder: the folder of ``<name>.dat`` files.

    Raises:
        NotImplementedError: the index holds bitsandbytes 8-bit statistics (``*.SCB``).

    Example:
        >>> from lockstep.utils.offload import offload_state_dict
        >>> offload_state_dict("offloaded", {"weight": torch.ones(1, 1), "bias": torch.full((1,), 2.0)})
        >>> with torch.device("meta"):
        ...     layer = torch.nn.Linear(1, 1)
        >>> import json, pathlib
        >>> index = json.loads(pathlib.Path("offloaded/index.json").read_text())
        >>> load_offloaded_weights(layer, index, "offloaded")
        >>> layer(torch.ones(1, 1))
        tensor([[3.]], grad_fn=<AddmmBackward0>)
    """
    if not index:
        return
    statistics = [name for name in index if "SCB" in name]
    if statistics:
        raise NotImplementedError(
            f"load_offloaded_weights(): the index holds bitsandbytes 8-bit statistics ({statistics[0]!r}), "
            "which lockstep does not support: lockstep does not integrate bitsandbytes."
        )
    for name, info in index.items():
        weight = load_offloaded_weight(os.path.join(offload_folder, f"{name}.dat"), info)
        set_module_tensor_to_device(model, name, "cpu", value=weight)


def has_offloaded_params(module: nn.Module) -> bool:
    """Whether ``module`` carries an offloading device hook (an ``AlignDevicesHook`` with ``offload=True``,
    attached by ``dispatch_model``, ``cpu_offload``, ``disk_offload`` or transformers' ``device_map``).

    A hook is recognised by its ``offload`` flag and its ``pre_forward``/``post_forward`` methods, so
    Accelerate's hooks count too.

    Example:
        >>> has_offloaded_params(torch.nn.Linear(1, 1))
        False
    """
    hook = getattr(module, "_hf_hook", None)
    return (
        hook is not None
        and bool(getattr(hook, "offload", False))
        and callable(getattr(hook, "pre_forward", None))
        and callable(getattr(hook, "post_forward", None))
    )


@contextlib.contextmanager
def align_module_device(
    module: nn.Module, execution_device: int | str | torch.device | None = None
) -> Iterator[None]:
    """Inside the block, ``module``'s own parameters are on ``execution_device``; afterwards they are back.

    A module with an offloading hook (:func:`has_offloaded_params`) is onloaded by its hook instead (on
    ``execution_device`` when given). Without a hook and without ``execution_device``, nothing moves.
    Only the module's own parameters move, not its children's.

    Args:
        module: the module.
        execution_device: where its parameters should be inside the block.

    Example:
        >>> layer = torch.nn.Linear(2, 2)
        >>> with align_module_device(layer, "cpu"):  # e.g. "cuda:0" to run it on a GPU for a moment
        ...     layer.weight.device.type
        'cpu'
    """
    if has_offloaded_params(module):
        hook: Any = module._hf_hook
        original = hook.execution_device
        if execution_device is not None:
            hook.execution_device = execution_device
        try:
            hook.pre_forward(module)
            yield
        finally:
            hook.post_forward(module, None)
            hook.execution_device = original
        return
    if execution_device is None:
        yield
        return
    devices = {name: param.device for name, param in module.named_parameters(recurse=False)}
    try:
        for name in devices:
            set_module_tensor_to_device(module, name, execution_device)
        yield
    finally:
        for name, device in devices.items():
            set_module_tensor_to_device(module, name, device)
