"""``accelerate.big_modeling``: building a model without allocating its weights, and running it across
GPUs, CPU memory and disk.

:func:`init_empty_weights` creates parameters on the meta device (shapes and dtypes, no memory), so a model
too large for the CPU can be built, sized (``lockstep.utils.compute_module_sizes``), planned
(``lockstep.utils.infer_auto_device_map``) and then filled: :func:`load_checkpoint_and_dispatch` loads a
checkpoint tensor by tensor into the plan and attaches the hooks (:mod:`lockstep.hooks`) that load each
offloaded block where it runs; :func:`dispatch_model`, :func:`cpu_offload`, :func:`cpu_offload_with_hook`
and :func:`disk_offload` do the dispatching part alone. A model can also be sharded by ``prepare`` with FSDP.

Example:
    >>> import torch
    >>> with init_empty_weights():
    ...     model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.BatchNorm1d(4096))
    >>> model[0].weight.device, model[1].running_mean.device  # buffers stay real unless include_buffers
    (device(type='meta'), device(type='cpu'))
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from lockstep.big_model.checkpoint_dispatch import load_checkpoint_and_dispatch
from lockstep.big_model.dispatch import cpu_offload, cpu_offload_with_hook, disk_offload, dispatch_model

__all__ = [
    "cpu_offload",
    "cpu_offload_with_hook",
    "disk_offload",
    "dispatch_model",
    "init_empty_weights",
    "init_on_device",
    "load_checkpoint_and_dispatch",
]


@contextmanager
def init_empty_weights(include_buffers: bool | None = None) -> Iterator[None]:
    """Create every parameter (and with ``include_buffers`` every buffer) on the meta device.

    Args:
        include_buffers: also put buffers (and every other tensor created inside the block) on the meta
            device; default False, as Accelerate's default.

    Example:
        >>> import torch
        >>> with init_empty_weights(include_buffers=True):
        ...     norm = torch.nn.BatchNorm1d(8)
        >>> norm.weight.is_meta, norm.running_var.is_meta
        (True, True)
    """
    with init_on_device(torch.device("meta"), include_buffers=include_buffers):
        yield


@contextmanager
def init_on_device(device: torch.device | str, include_buffers: bool | None = None) -> Iterator[None]:
    """Create every parameter registered inside the block on ``device`` (buffers too with ``include_buffers``).

    Parameters keep their class, ``requires_grad`` and extra attributes. Without ``include_buffers`` the
    parameters are created where torch would create them and moved at registration; with it, the block runs
    under ``torch.device(device)``, so every tensor created inside (buffers, temporaries) lands there.

    Args:
        device: where the parameters go, e.g. ``"meta"`` or ``"cuda:0"``.
        include_buffers: also create buffers (and other tensors) on ``device``.

    Example:
        >>> import torch
        >>> with init_on_device("meta"):
        ...     layer = torch.nn.Linear(2, 2)
        >>> layer.weight.device, layer.weight.requires_grad
        (device(type='meta'), True)
    """
    device = torch.device(device)
    if include_buffers:
        with device:
            yield
        return
    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is None or param.device == device:
            return  # already there: keeping the object keeps ties made in __init__ (head.weight = embed.weight)
        registered = module._parameters[name]
        moved = type(registered)(registered.detach().to(device), requires_grad=registered.requires_grad)
        moved.__dict__.update(registered.__dict__)
        module._parameters[name] = moved

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]
