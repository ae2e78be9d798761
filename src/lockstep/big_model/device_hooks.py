"""Hooks that move weights and inputs: :class:`AlignDevicesHook`, :class:`CpuOffload`, :class:`UserCpuOffloadHook`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lockstep.big_model.module_hooks import ModelHook, remove_hook_from_module
from lockstep.utils.modeling import named_module_tensors, set_module_tensor_to_device
from lockstep.utils.operations import find_device, send_to_device

__all__ = ["AlignDevicesHook", "CpuOffload", "UserCpuOffloadHook"]

Device = int | str | torch.device
TiedParamsMap = dict[int, dict[Any, torch.Tensor]]


class AlignDevicesHook(ModelHook):
    """Run a module on ``execution_device``: its inputs are moved there and, with ``offload``, its weights too.

    With ``offload``, the module's parameters (and buffers with ``offload_buffers``) live on the meta device
    between calls: ``pre_forward`` loads each from ``weights_map`` onto ``execution_device`` and
    ``post_forward`` puts it back on the meta device, so the weights take memory only while the module runs.
    Without ``offload``, attaching the hook moves the weights to ``execution_device`` once.

    Args:
        execution_device: where the forward runs (None: leave inputs and weights where they are).
        offload: keep the weights on the meta device between calls.
        io_same_device: return the output on the device of the first input tensor.
        weights_map: name -> tensor mapping the offloaded weights are read from (names relative to the
            module; e.g. a :class:`lockstep.utils.offload.PrefixedDataset` over a disk-offload folder). When
            None, the module's own weights, copied to the CPU when the hook is attached.
        offload_buffers: offload the buffers too.
        place_submodules: handle the tensors of every submodule, not only the module's own.
        skip_keys: keys of dict inputs and outputs that are not moved (e.g. a KV cache).
        tied_params_map: ``{data_ptr: {device: tensor}}`` shared by the hooks of one model, so that weights
            tied in the model are loaded once per device.

    Example:
        >>> from lockstep.hooks import add_hook_to_module
        >>> layer = add_hook_to_module(torch.nn.Linear(2, 2), AlignDevicesHook("cpu", offload=True))
        >>> layer.weight.device.type, layer(torch.ones(1, 2)).shape
        ('meta', torch.Size([1, 2]))
    """

    def __init__(
        self,
        execution_device: Device | None = None,
        offload: bool = False,
        io_same_device: bool = False,
        weights_map: Mapping[str, torch.Tensor] | None = None,
        offload_buffers: bool = False,
        place_submodules: bool = False,
        skip_keys: str | Sequence[str] | None = None,
        tied_params_map: TiedParamsMap | None = None,
    ) -> None:
        self.execution_device = execution_device
        self.offload = offload
        self.io_same_device = io_same_device
        self.weights_map = weights_map
        self.offload_buffers = offload_buffers
        self.place_submodules = place_submodules
        self.skip_keys = skip_keys
        self.tied_params_map = tied_params_map
        self.input_device: torch.device | None = None
        self.original_devices: dict[str, torch.device] = {}
        self.tied_pointers_to_remove: set[tuple[int, Any]] = set()

    def __repr__(self) -> str:
        return (
            f"AlignDevicesHook(execution_device={self.execution_device}, offload={self.offload}, "
            f"io_same_device={self.io_same_device}, offload_buffers={self.offload_buffers}, "
            f"place_submodules={self.place_submodules}, skip_keys={self.skip_keys!r})"
        )

    def _offloaded(self, module: nn.Module) -> list[str]:
        """The names of the tensors moved in and out at each call (non-persistent buffers stay)."""
        return [
            name
            for name, _ in named_module_tensors(
                module,
                include_buffers=self.offload_buffers,
                recurse=self.place_submodules,
                remove_non_persistent=True,
            )
        ]

    def init_hook(self, module: nn.Module) -> nn.Module:
        if not self.offload and self.execution_device is not None:
            target = _torch_device(self.execution_device)
            for name, tensor in named_module_tensors(module, recurse=self.place_submodules):
                if tensor.device == target:
                    continue  # already there: keeping the object keeps weights tied in the model tied
                self._to_execution_device(module, name)
        elif self.offload:
            self._offload_at_init(module)
        return module

    def _offload_at_init(self, module: nn.Module) -> None:
        self.original_devices = {
            name: tensor.device
            for name, tensor in named_module_tensors(module, recurse=self.place_submodules)
        }
        if self.weights_map is None:
            self.weights_map = {
                name: tensor.detach().to("cpu")
                for name, tensor in named_module_tensors(
                    module, include_buffers=self.offload_buffers, recurse=self.place_submodules
                )
            }
        tensors = dict(named_module_tensors(module, recurse=self.place_submodules))
        for name in self._offloaded(module):
            if self._is_tied(tensors[name]):
                # the copy read from weights_map is what later modules holding the same weight reuse
                self.tied_params_map.setdefault(self.weights_map[name].data_ptr(), {})  # type: ignore[union-attr]
            set_module_tensor_to_device(module, name, "meta", clear_cache=False)
        if self.execution_device is None:
            return
        if not self.offload_buffers:
            for name, _ in module.named_buffers(recurse=self.place_submodules):
                self._to_execution_device(module, name)
        else:  # non-persistent buffers are not in the weights map: they stay, on the execution device
            for name in _non_persistent(module, self.place_submodules):
                set_module_tensor_to_device(module, name, self.execution_device, clear_cache=False)

    def _to_execution_device(self, module: nn.Module, name: str) -> None:
        assert self.execution_device is not None
        set_module_tensor_to_device(
            module, name, self.execution_device, tied_params_map=self.tied_params_map, clear_cache=False
        )

    def _is_tied(self, tensor: torch.Tensor) -> bool:
        pointer = tensor.data_ptr() if tensor.device.type != "meta" else 0
        return self.tied_params_map is not None and pointer != 0 and pointer in self.tied_params_map

    def pre_forward(
        self, module: nn.Module, *args: Any, **kwargs: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.io_same_device:
            self.input_device = find_device([args, kwargs])
        if self.offload:
            self._load_weights(module)
        if self.execution_device is None:
            return args, kwargs
        return (
            send_to_device(args, self.execution_device),
            send_to_device(kwargs, self.execution_device, skip_keys=self.skip_keys),
        )

    def _load_weights(self, module: nn.Module) -> None:
        assert self.weights_map is not None and self.execution_device is not None
        self.tied_pointers_to_remove = set()
        for name in self._offloaded(module):
            value = self.weights_map[name]
            pointer = value.data_ptr()
            if self.tied_params_map is not None and pointer in self.tied_params_map:
                if self.execution_device not in self.tied_params_map[pointer]:
                    self.tied_pointers_to_remove.add((pointer, self.execution_device))
            set_module_tensor_to_device(
                module,
                name,
                self.execution_device,
                value=value,
                tied_params_map=self.tied_params_map,
                clear_cache=False,
            )

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        if self.offload:
            for name in self._offloaded(module):
                set_module_tensor_to_device(module, name, "meta", clear_cache=False)
            if self.tied_params_map is not None:
                for pointer, device in self.tied_pointers_to_remove:
                    self.tied_params_map[pointer].pop(device, None)
            self.tied_pointers_to_remove = set()
        if self.io_same_device and self.input_device is not None:
            output = send_to_device(output, self.input_device, skip_keys=self.skip_keys)
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        if self.offload and self.weights_map is not None:
            for name, device in self.original_devices.items():
                if device.type != "meta":
                    set_module_tensor_to_device(module, name, device, value=self.weights_map.get(name))
        return module


def _torch_device(device: Device) -> torch.device:
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cuda", device)
    return torch.device(device)


def _non_persistent(module: nn.Module, recurse: bool) -> list[str]:
    found = []
    for prefix, submodule in module.named_modules() if recurse else [("", module)]:
        for name in submodule._non_persistent_buffers_set:
            found.append(f"{prefix}.{name}" if prefix else name)
    return found


def _default_execution_device() -> torch.device:
    from lockstep.state import PartialState

    return PartialState().default_device


class CpuOffload(ModelHook):
    """Keep a whole model on the CPU and move it to ``execution_device`` when it runs.

    The model stays on the execution device after its forward, until :meth:`UserCpuOffloadHook.offload`
    sends it back, or until the next model of a pipeline runs (``prev_module_hook``): a pipeline of models
    then holds one model at a time on the execution device.

    Args:
        execution_device: where the model runs (the process's device when None).
        prev_module_hook: the hook of the model that runs before this one, offloaded when this one starts.

    Example:
        >>> from lockstep.hooks import add_hook_to_module
        >>> model = add_hook_to_module(torch.nn.Linear(2, 2), CpuOffload("cpu"))
        >>> model(torch.ones(1, 2)).device.type
        'cpu'
    """

    def __init__(
        self, execution_device: Device | None = None, prev_module_hook: UserCpuOffloadHook | None = None
    ) -> None:
        self.prev_module_hook = prev_module_hook
        self.execution_device = (
            execution_device if execution_device is not None else _default_execution_device()
        )

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module.to("cpu")

    def pre_forward(
        self, module: nn.Module, *args: Any, **kwargs: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.prev_module_hook is not None:
            self.prev_module_hook.offload()
            from lockstep.memory import clear_device_cache

            clear_device_cache()
        module.to(self.execution_device)
        return send_to_device(args, self.execution_device), send_to_device(kwargs, self.execution_device)


class UserCpuOffloadHook:
    """What :func:`lockstep.cpu_offload_with_hook` returns: offload the model, or remove its hook.

    Example:
        >>> from lockstep.hooks import add_hook_to_module
        >>> model = torch.nn.Linear(2, 2)
        >>> hook = CpuOffload("cpu")
        >>> user_hook = UserCpuOffloadHook(add_hook_to_module(model, hook), hook)
        >>> user_hook.offload(); user_hook.remove(); hasattr(model, "_hf_hook")
        False
    """

    def __init__(self, model: nn.Module, hook: CpuOffload) -> None:
        self.model = model
        self.hook = hook

    def offload(self) -> None:
        """Send the model back to the CPU."""
        self.hook.init_hook(self.model)

    def remove(self) -> None:
        """Remove the hook (the model stays where it is)."""
        remove_hook_from_module(self.model)
