"""Accelerate's big-model inference: running a model whose weights live on several devices, in CPU memory
or on disk, with hooks (:mod:`lockstep.hooks`) that bring each block's weights to where it executes.

:func:`dispatch_model` follows a device map (module name -> GPU index, ``"cpu"`` or ``"disk"``);
:func:`cpu_offload` and :func:`disk_offload` keep a whole model in CPU memory or on disk and load one
module at a time on the execution device; :func:`cpu_offload_with_hook` moves a whole model in and out (a
pipeline of models holds one at a time); :func:`lockstep.load_checkpoint_and_dispatch` plans, loads and dispatches.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    >>> model = dispatch_model(model, {"0": "cpu", "1": "disk"}, offload_dir="offload")
    >>> model[1].weight.device.type, model(torch.ones(1, 4)).shape, model.hf_device_map
    ('meta', torch.Size([1, 2]), {'0': 'cpu', '1': 'disk'})
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lockstep.big_model.attach_hooks import attach_align_device_hook, attach_align_device_hook_on_blocks
from lockstep.big_model.device_hooks import AlignDevicesHook, CpuOffload, UserCpuOffloadHook
from lockstep.big_model.module_hooks import add_hook_to_module
from lockstep.utils.modeling import check_device_map, find_tied_parameters, retie_parameters
from lockstep.utils.offload import (
    INDEX_FILE,
    OffloadedWeightsLoader,
    extract_submodules_state_dict,
    offload_state_dict,
)

__all__ = [
    "check_device_map_devices",
    "cpu_offload",
    "cpu_offload_with_hook",
    "disk_offload",
    "dispatch_model",
]

PathLike = str | os.PathLike[str]
Device = int | str | torch.device
_OFFLOAD_TARGETS = ("cpu", "disk")


def _offload_every_module(
    model: nn.Module,
    weights_map: Mapping[str, torch.Tensor],
    *,
    execution_device: Device | None,
    offload_buffers: bool,
    preload_module_classes: Sequence[str] | None,
) -> nn.Module:
    """Hook ``model`` so that each module's weights come from ``weights_map`` onto ``execution_device`` (the
    device of its first parameter when None) as it runs, and its outputs return to the inputs' device."""
    if execution_device is None:
        execution_device = next(iter(model.parameters())).device
    add_hook_to_module(model, AlignDevicesHook(io_same_device=True), append=True)
    attach_align_device_hook(
        model,
        execution_device=execution_device,
        offload=True,
        offload_buffers=offload_buffers,
        weights_map=weights_map,
        preload_module_classes=preload_module_classes,
    )
    return model


def cpu_offload(
    model: nn.Module,
    execution_device: Device | None = None,
    offload_buffers: bool = False,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    preload_module_classes: Sequence[str] | None = None,
) -> nn.Module:
    """Keep ``model``'s weights in CPU memory and load each module's onto ``execution_device`` as it runs.

    Between calls the parameters are on the meta device; the model's output comes back on its input's device.

    Args:
        model: the model.
        execution_device: where the forwards run (the device of the model's first parameter when None).
        offload_buffers: offload the buffers too (otherwise they move to ``execution_device`` once).
        state_dict: the weights to keep on the CPU (the model's own, copied to the CPU, when None).
        preload_module_classes: class names of modules whose whole weights are loaded before their forward.

    Example:
        >>> model = cpu_offload(torch.nn.Linear(2, 2), execution_device="cpu")  # e.g. "cuda:0" on a GPU
        >>> model.weight.device.type, model(torch.ones(1, 2)).shape
        ('meta', torch.Size([1, 2]))
    """
    if state_dict is None:
        state_dict = {name: tensor.to("cpu") for name, tensor in model.state_dict().items()}
    return _offload_every_module(
        model,
        state_dict,
        execution_device=execution_device,
        offload_buffers=offload_buffers,
        preload_module_classes=preload_module_classes,
    )


def cpu_offload_with_hook(
    model: nn.Module,
    execution_device: Device | None = None,
    prev_module_hook: UserCpuOffloadHook | None = None,
) -> tuple[nn.Module, UserCpuOffloadHook]:
    """Keep ``model`` on the CPU; it moves whole to ``execution_device`` when it runs and stays there until
    ``hook.offload()``, or until the next model of a chain (built with ``prev_module_hook``) runs.

    Returns:
        The model and its :class:`lockstep.hooks.UserCpuOffloadHook`.

    Example:
        >>> encoder, hook1 = cpu_offload_with_hook(torch.nn.Linear(2, 2), execution_device="cpu")
        >>> decoder, hook2 = cpu_offload_with_hook(torch.nn.Linear(2, 2), "cpu", prev_module_hook=hook1)
        >>> out = decoder(encoder(torch.ones(1, 2)))  # running the decoder offloaded the encoder
        >>> hook2.offload()  # and this offloads the decoder
    """
    hook = CpuOffload(execution_device=execution_device, prev_module_hook=prev_module_hook)
    add_hook_to_module(model, hook, append=True)
    return model, UserCpuOffloadHook(model, hook)


def disk_offload(
    model: nn.Module,
    offload_dir: PathLike,
    execution_device: Device | None = None,
    offload_buffers: bool = False,
    preload_module_classes: Sequence[str] | None = None,
) -> nn.Module:
    """Write ``model``'s weights to ``offload_dir`` (memory-mapped files) and load each module's from there
    onto ``execution_device`` as it runs. A folder already holding an ``index.json`` is used as it is.

    Example:
        >>> model = disk_offload(torch.nn.Linear(2, 2), "weights_on_disk", execution_device="cpu")
        >>> model.weight.device.type, model(torch.ones(1, 2)).shape
        ('meta', torch.Size([1, 2]))
    """
    if not (Path(offload_dir) / INDEX_FILE).is_file():
        offload_state_dict(offload_dir, model.state_dict())
    return _offload_every_module(
        model,
        OffloadedWeightsLoader(save_folder=offload_dir),
        execution_device=execution_device,
        offload_buffers=offload_buffers,
        preload_module_classes=preload_module_classes,
    )


def _accelerator_count() -> int:
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    xpu = getattr(torch, "xpu", None)
    return xpu.device_count() if xpu is not None and xpu.is_available() else 0


def check_device_map_devices(device_map: Mapping[str, Device]) -> None:
    """Raise ``ValueError`` for a device that does not exist here: an unknown name, or a GPU index beyond
    the GPUs this machine has."""
    count = _accelerator_count()
    for name, device in device_map.items():
        if isinstance(device, bool) or not isinstance(device, (int, str, torch.device)):
            raise ValueError(
                f"device_map[{name!r}] = {device!r} is not a device: use a GPU index (0, 1, ...), 'cpu', 'disk' "
                "or a torch device such as 'cuda:0'."
            )
        if isinstance(device, int):
            if not 0 <= device < count:
                raise ValueError(
                    f"device_map[{name!r}] = {device} names GPU {device}, but this machine has {count} GPU(s). "
                    "Map the module to an existing GPU, 'cpu' or 'disk'."
                )
            continue
        if device == "disk":
            continue
        try:
            torch.device(device)
        except RuntimeError:
            raise ValueError(
                f"device_map[{name!r}] = {device!r} is not a device: use a GPU index (0, 1, ...), 'cpu', "
                "'disk' or a torch device such as 'cuda:0'."
            ) from None


def _main_device(device_map: Mapping[str, Device], main_device: Device | None) -> Device:
    if main_device is not None:
        return main_device
    on_accelerators = [device for device in device_map.values() if str(device) not in _OFFLOAD_TARGETS]
    return on_accelerators[0] if on_accelerators else "cpu"


def _weights_map(
    model: nn.Module,
    device_map: Mapping[str, Device],
    main_device: Device,
    state_dict: Mapping[str, torch.Tensor] | None,
    offload_dir: PathLike | None,
    offload_index: Mapping[str, Any] | None,
) -> OffloadedWeightsLoader | None:
    """Where offloaded blocks read their weights: CPU memory (``state_dict``) and the disk folder."""
    cpu_modules = [name for name, device in device_map.items() if device == "cpu"]
    if str(main_device) != "cpu" and state_dict is None and cpu_modules:
        state_dict = extract_submodules_state_dict(model.state_dict(), cpu_modules)
    disk_modules = [name for name, device in device_map.items() if device == "disk"]
    if disk_modules and offload_dir is None and offload_index is None:
        raise ValueError(
            f"dispatch_model(): the device_map sends {disk_modules[:5]} to 'disk', and no offload_dir was "
            "given. Pass offload_dir= (a folder for the offloaded weights)."
        )
    if disk_modules and offload_index is None and not (Path(offload_dir) / INDEX_FILE).is_file():  # type: ignore[arg-type]
        offload_state_dict(offload_dir, extract_submodules_state_dict(model.state_dict(), disk_modules))  # type: ignore[arg-type]
    save_folder = offload_dir if disk_modules else None
    if state_dict is None and save_folder is None and offload_index is None:
        return None
    return OffloadedWeightsLoader(
        state_dict=state_dict,
        save_folder=save_folder,
        index=offload_index,
        device=main_device if offload_index is not None else None,
    )


def dispatch_model(
    model: nn.Module,
    device_map: Mapping[str, Device],
    main_device: Device | None = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    offload_dir: PathLike | None = None,
    offload_index: Mapping[str, Any] | None = None,
    offload_buffers: bool = False,
    skip_keys: str | Sequence[str] | None = None,
    preload_module_classes: Sequence[str] | None = None,
    force_hooks: bool = False,
) -> nn.Module:
    """Place ``model``'s blocks as ``device_map`` says and attach the hooks that run it across them.

    Blocks mapped to a GPU are moved there. Blocks mapped to ``"disk"`` (and to ``"cpu"`` when the main device
    is a GPU) are offloaded: their weights stay on the meta device and are loaded onto the main device for
    the length of their forward, from CPU memory or from memory-mapped files in ``offload_dir``. Inputs move
    to each block's device and the output comes back on the input's device. Weights tied in the model stay
    tied, and ``model.hf_device_map`` holds the map (as transformers expects).

    Args:
        model: the model (its offloaded blocks may be on the meta device when ``offload_dir`` holds them).
        device_map: module name -> GPU index, ``"cpu"`` or ``"disk"``; ``""`` is the whole model.
        main_device: where offloaded blocks run (the first GPU of the map, or the CPU).
        state_dict: the CPU-offloaded weights (taken from the model when None).
        offload_dir: the folder of disk-offloaded weights (written from the model when it has no index).
        offload_index: an offload index to read the disk weights from (e.g. safetensors entries).
        offload_buffers: offload the buffers of offloaded blocks too.
        skip_keys: keys of dict inputs and outputs that are not moved (e.g. ``"past_key_values"``).
        preload_module_classes: class names of modules whose whole weights are loaded before their forward.
        force_hooks: attach hooks even when the whole map names one device.

    Raises:
        ValueError: the map leaves a weight unassigned or names a device that does not exist, or maps to
            ``"disk"`` without ``offload_dir``/``offload_index``, or maps the whole model to ``"disk"``.

    Example:
        >>> model = dispatch_model(torch.nn.Linear(2, 2), {"": "cpu"})
        >>> model.hf_device_map
        {'': 'cpu'}
    """
    check_device_map(model, device_map)
    check_device_map_devices(device_map)
    devices = {str(device) for device in device_map.values()}
    if not force_hooks and len(devices) == 1:
        device = next(iter(device_map.values()))
        if str(device) == "disk":
            raise ValueError(
                "dispatch_model(): the device_map sends the whole model to 'disk'. Use disk_offload(model, "
                "offload_dir) instead, or keep some blocks on a GPU or 'cpu'."
            )
        model.to(device)
    else:
        main_device = _main_device(device_map, main_device)
        weights_map = _weights_map(model, device_map, main_device, state_dict, offload_dir, offload_index)
        _attach_hooks(
            model, device_map, main_device, weights_map, offload_buffers, skip_keys, preload_module_classes
        )
    model.hf_device_map = dict(device_map)
    return model


def _attach_hooks(
    model: nn.Module,
    device_map: Mapping[str, Device],
    main_device: Device,
    weights_map: OffloadedWeightsLoader | None,
    offload_buffers: bool,
    skip_keys: str | Sequence[str] | None,
    preload_module_classes: Sequence[str] | None,
) -> None:
    offloaded = ("disk",) if str(main_device) in ("cpu", "mps") else _OFFLOAD_TARGETS
    execution = {
        name: main_device if str(device) in _OFFLOAD_TARGETS else device
        for name, device in device_map.items()
    }
    execution[""] = main_device
    offload = {name: str(device) in offloaded for name, device in device_map.items()}
    tied = find_tied_parameters(model)
    tied_params_map: dict[int, dict[Any, torch.Tensor]] = {}
    for group in tied:
        for name in group:
            tensor = model.get_parameter(name)
            if tensor.device.type != "meta":
                tied_params_map[tensor.data_ptr()] = {}
    attach_align_device_hook_on_blocks(
        model,
        execution_device=execution,
        offload=offload,
        offload_buffers=offload_buffers,
        weights_map=weights_map,
        skip_keys=skip_keys,
        preload_module_classes=preload_module_classes,
        tied_params_map=tied_params_map,
    )
    retie_parameters(model, tied)
    if any(offload.values()):
        _refuse_moves(model)


def _refuse_moves(model: nn.Module) -> None:
    """``model.to()``/``.cuda()`` raise while blocks are offloaded (their weights are on the meta device and
    their hooks decide where they load); once the hooks are removed they work again."""
    for method in ("to", "cuda"):
        original = getattr(model, method)

        def guarded(*args: Any, _original: Any = original, _method: str = method, **kwargs: Any) -> Any:
            if any(parameter.device.type == "meta" for parameter in model.parameters()):
                raise RuntimeError(
                    f"{type(model).__name__}.{_method}() was called on a model dispatched with offloaded blocks "
                    "(hf_device_map names 'cpu' or 'disk'): their hooks load each block's weights where it runs, "
                    "so the model cannot be moved. Remove the hooks first "
                    "(lockstep.hooks.remove_hook_from_module(model, recurse=True)), or dispatch it with another "
                    "device_map."
                )
            return _original(*args, **kwargs)

        setattr(model, method, functools.wraps(original)(guarded))
