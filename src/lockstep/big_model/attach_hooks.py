"""Attaching :class:`AlignDevicesHook` to every module of a model that holds tensors, or block by block."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lockstep.big_model.device_hooks import AlignDevicesHook, Device, TiedParamsMap
from lockstep.big_model.module_hooks import add_hook_to_module
from lockstep.utils.modeling import named_module_tensors
from lockstep.utils.offload import PrefixedDataset

__all__ = ["attach_align_device_hook", "attach_align_device_hook_on_blocks", "attach_execution_device_hook"]

WeightsMap = Mapping[str, torch.Tensor]


def _holds_tensors(module: nn.Module) -> bool:
    return next(named_module_tensors(module), None) is not None


def _is_preloaded(module: nn.Module, preload_module_classes: Sequence[str] | None) -> bool:
    return bool(preload_module_classes) and type(module).__name__ in preload_module_classes  # type: ignore[operator]


def attach_execution_device_hook(
    module: nn.Module,
    execution_device: Device,
    skip_keys: str | Sequence[str] | None = None,
    preload_module_classes: Sequence[str] | None = None,
    tied_params_map: TiedParamsMap | None = None,
) -> None:
    """Give every submodule holding tensors and no hook yet an :class:`AlignDevicesHook` that moves its
    inputs to ``execution_device`` (its weights are left where they are).

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> attach_execution_device_hook(model, "cpu")
        >>> model[0]._hf_hook.execution_device
        'cpu'
    """
    if not hasattr(module, "_hf_hook") and _holds_tensors(module):
        hook = AlignDevicesHook(execution_device, skip_keys=skip_keys, tied_params_map=tied_params_map)
        add_hook_to_module(module, hook)
    if _is_preloaded(module, preload_module_classes):
        return
    for child in module.children():
        attach_execution_device_hook(
            child, execution_device, skip_keys, preload_module_classes, tied_params_map
        )


def attach_align_device_hook(
    module: nn.Module,
    execution_device: Device | None = None,
    offload: bool = False,
    weights_map: WeightsMap | None = None,
    offload_buffers: bool = False,
    module_name: str = "",
    skip_keys: str | Sequence[str] | None = None,
    preload_module_classes: Sequence[str] | None = None,
    tied_params_map: TiedParamsMap | None = None,
) -> None:
    """Attach an :class:`AlignDevicesHook` to ``module`` and each submodule that holds tensors of its own.

    Each hook reads its weights from ``weights_map`` under its module's qualified name. A module whose class
    name is in ``preload_module_classes`` gets one hook for all its submodules' weights, loaded before its
    forward (for modules that read a child's weight directly instead of calling the child).

    Args:
        module: the module.
        execution_device: where the forwards run.
        offload: keep the weights on the meta device between calls.
        weights_map: full-name -> tensor mapping of the offloaded weights.
        offload_buffers: offload the buffers too.
        module_name: the qualified name of ``module`` in ``weights_map``.
        skip_keys: dict keys of inputs and outputs that are not moved.
        preload_module_classes: class names of modules offloaded as one block.
        tied_params_map: the shared map of tied weights (see :class:`AlignDevicesHook`).

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> attach_align_device_hook(model, "cpu", offload=True, weights_map=model.state_dict())
        >>> model[0].weight.device.type
        'meta'
    """
    preloaded = offload and _is_preloaded(module, preload_module_classes)
    if _holds_tensors_directly(module) or preloaded:
        prefix = f"{module_name}." if module_name else ""
        hook = AlignDevicesHook(
            execution_device=execution_device,
            offload=offload,
            weights_map=PrefixedDataset(weights_map, prefix) if weights_map is not None else None,
            offload_buffers=offload_buffers,
            place_submodules=preloaded,
            skip_keys=skip_keys,
            tied_params_map=tied_params_map,
        )
        add_hook_to_module(module, hook, append=True)
    if preloaded:
        return
    for child_name, child in module.named_children():
        attach_align_device_hook(
            child,
            execution_device=execution_device,
            offload=offload,
            weights_map=weights_map,
            offload_buffers=offload_buffers,
            module_name=f"{module_name}.{child_name}" if module_name else child_name,
            skip_keys=skip_keys,
            preload_module_classes=preload_module_classes,
            tied_params_map=tied_params_map,
        )


def _holds_tensors_directly(module: nn.Module) -> bool:
    return next(named_module_tensors(module, recurse=False), None) is not None


def _per_module(value: Any, keys: Any) -> dict[str, Any]:
    return dict(value) if isinstance(value, Mapping) else dict.fromkeys(keys, value)


def attach_align_device_hook_on_blocks(
    module: nn.Module,
    execution_device: Device | Mapping[str, Device] | None = None,
    offload: bool | Mapping[str, bool] = False,
    weights_map: WeightsMap | None = None,
    offload_buffers: bool = False,
    module_name: str = "",
    skip_keys: str | Sequence[str] | None = None,
    preload_module_classes: Sequence[str] | None = None,
    tied_params_map: TiedParamsMap | None = None,
) -> None:
    """Attach hooks block by block, as a device map says: ``execution_device`` and ``offload`` map module
    names (the device map's keys) to where each block runs and whether its weights are offloaded.

    A block that is not offloaded is moved to its execution device once (one hook over all its weights);
    an offloaded block gets :func:`attach_align_device_hook`'s per-module hooks; the whole model (``""``)
    gets a hook that returns outputs on the inputs' device.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        >>> attach_align_device_hook_on_blocks(
        ...     model, {"": "cpu", "0": "cpu", "1": "cpu"}, {"0": False, "1": True}, weights_map=model.state_dict()
        ... )
        >>> model[0].weight.device.type, model[1].weight.device.type
        ('cpu', 'meta')
    """
    if not isinstance(execution_device, Mapping) and not isinstance(offload, Mapping):
        if offload:
            attach_align_device_hook(
                module,
                execution_device,
                True,
                weights_map,
                offload_buffers,
                module_name,
                skip_keys,
                preload_module_classes,
                tied_params_map,
            )
        else:
            hook = AlignDevicesHook(
                execution_device,
                io_same_device=True,
                skip_keys=skip_keys,
                place_submodules=True,
                tied_params_map=tied_params_map,
            )
            add_hook_to_module(module, hook)
        return
    devices = _per_module(execution_device, offload)
    offloads = _per_module(offload, devices)
    _attach_block(
        module,
        module_name,
        devices,
        offloads,
        weights_map,
        offload_buffers,
        skip_keys,
        preload_module_classes,
        tied_params_map,
    )
    for child_name, child in module.named_children():
        attach_align_device_hook_on_blocks(
            child,
            devices,
            offloads,
            weights_map,
            offload_buffers,
            f"{module_name}.{child_name}" if module_name else child_name,
            skip_keys,
            preload_module_classes,
            tied_params_map,
        )


def _attach_block(
    module: nn.Module,
    name: str,
    devices: Mapping[str, Device],
    offloads: Mapping[str, bool],
    weights_map: WeightsMap | None,
    offload_buffers: bool,
    skip_keys: str | Sequence[str] | None,
    preload_module_classes: Sequence[str] | None,
    tied_params_map: TiedParamsMap | None,
) -> None:
    """The hooks of one module of a device map (``name`` in ``devices``), or the model's own (``""``)."""
    if name in devices and name in offloads:
        if not offloads[name]:
            hook = AlignDevicesHook(
                devices[name],
                io_same_device=name == "",
                offload_buffers=offload_buffers,
                place_submodules=True,
                skip_keys=skip_keys,
                tied_params_map=tied_params_map,
            )
            add_hook_to_module(module, hook)
        else:
            attach_align_device_hook(
                module,
                devices[name],
                True,
                weights_map,
                offload_buffers,
                name,
                skip_keys,
                preload_module_classes,
                tied_params_map,
            )
            if not hasattr(module, "_hf_hook"):
                hook = AlignDevicesHook(
                    devices[name],
                    io_same_device=name == "",
                    skip_keys=skip_keys,
                    tied_params_map=tied_params_map,
                )
                add_hook_to_module(module, hook)
        attach_execution_device_hook(
            module, devices[name], skip_keys, preload_module_classes, tied_params_map
        )
    elif name == "":
        hook = AlignDevicesHook(
            devices.get(""), io_same_device=True, skip_keys=skip_keys, tied_params_map=tied_params_map
        )
        add_hook_to_module(module, hook)
