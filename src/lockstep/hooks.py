"""Accelerate's ``accelerate.hooks`` import path (the hooks live in :mod:`lockstep.big_model`): hooks that wrap a module's forward, and the ones that move weights between devices.

A hook (:class:`ModelHook`) runs code before and after a module's forward; :func:`add_hook_to_module`
attaches one (stored as ``module._hf_hook``, the attribute transformers reads) and
:func:`remove_hook_from_module` gives the module its forward back. :class:`AlignDevicesHook` is what
big-model inference is made of: it moves a module's inputs to its execution device and, when the module is
offloaded, loads its weights there only for the length of its forward (from CPU memory or from a
memory-mapped disk folder). :func:`lockstep.dispatch_model`, :func:`lockstep.cpu_offload` and
:func:`lockstep.disk_offload` attach these hooks for a whole model from a device map.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> attach_align_device_hook(model, execution_device="cpu", offload=True, weights_map=model.state_dict())
    >>> model[0].weight.device.type  # on the meta device until the layer runs
    'meta'
    >>> model(torch.ones(1, 4)).shape
    torch.Size([1, 2])
    >>> model = remove_hook_from_module(model, recurse=True)
    >>> model[0].weight.device.type
    'cpu'
"""

from lockstep.big_model.attach_hooks import (
    attach_align_device_hook,
    attach_align_device_hook_on_blocks,
    attach_execution_device_hook,
)
from lockstep.big_model.device_hooks import AlignDevicesHook, CpuOffload, UserCpuOffloadHook
from lockstep.big_model.module_hooks import (
    ModelHook,
    SequentialHook,
    add_hook_to_module,
    remove_hook_from_module,
    remove_hook_from_submodules,
)

__all__ = [
    "AlignDevicesHook",
    "CpuOffload",
    "ModelHook",
    "SequentialHook",
    "UserCpuOffloadHook",
    "add_hook_to_module",
    "attach_align_device_hook",
    "attach_align_device_hook_on_blocks",
    "attach_execution_device_hook",
    "remove_hook_from_module",
    "remove_hook_from_submodules",
]
