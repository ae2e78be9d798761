"""``load_checkpoint_and_dispatch``: plan a device map under a memory budget, load a checkpoint straight
into it, and dispatch the model (:mod:`lockstep.big_modeling`'s entry point for models larger than memory).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lockstep.big_model.dispatch import PathLike, check_device_map_devices, dispatch_model
from lockstep.utils.modeling import (
    check_device_map,
    get_balanced_memory,
    infer_auto_device_map,
    load_checkpoint_in_model,
)

__all__ = ["load_checkpoint_and_dispatch"]

PLANS = ("auto", "balanced", "balanced_low_0", "sequential")


def _plan(
    model: nn.Module,
    device_map: str,
    max_memory: Mapping[int | str, int | str] | None,
    no_split_module_classes: Sequence[str] | None,
    dtype: str | torch.dtype | None,
    offload_buffers: bool,
) -> dict[str, int | str]:
    if device_map not in PLANS:
        raise ValueError(
            f"load_checkpoint_and_dispatch(device_map={device_map!r}): a device_map given as a string must be "
            f"one of {', '.join(PLANS)}; or pass a dict of module name -> device."
        )
    if device_map != "sequential":
        max_memory = get_balanced_memory(
            model, max_memory, no_split_module_classes, dtype, low_zero=device_map == "balanced_low_0"
        )
    return infer_auto_device_map(
        model, max_memory, no_split_module_classes, dtype, offload_buffers=offload_buffers
    )


def load_checkpoint_and_dispatch(
    model: nn.Module,
    checkpoint: PathLike,
    device_map: str | Mapping[str, int | str | torch.device] | None = None,
    max_memory: Mapping[int | str, int | str] | None = None,
    no_split_module_classes: Sequence[str] | None = None,
    offload_folder: PathLike | None = None,
    offload_buffers: bool = False,
    dtype: str | torch.dtype | None = None,
    offload_state_dict: bool | None = None,
    skip_keys: str | Sequence[str] | None = None,
    preload_module_classes: Sequence[str] | None = None,
    force_hooks: bool = False,
    strict: bool = False,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
) -> nn.Module:
    """Load ``checkpoint`` into ``model`` (built with ``init_empty_weights``) as a device map says, and
    dispatch it with :func:`lockstep.dispatch_model`.

    The checkpoint is read one tensor at a time (safetensors; a sharded checkpoint through its
    ``*.index.json``): each tensor goes to its block's device, or, for a block mapped to ``"disk"``, into a
    memory-mapped file in ``offload_folder`` that the block reads when it runs. So a model larger than the
    CPU's memory runs with the resident memory of the blocks kept in memory plus one block at a time.

    Args:
        model: the model, usually on the meta device.
        checkpoint: a weight file, an index, or a folder holding either.
        device_map: a dict (module name -> GPU index, ``"cpu"`` or ``"disk"``), or a plan:
            ``"auto"``/``"balanced"`` (spread evenly over the GPUs), ``"balanced_low_0"`` (GPU 0 kept as
            empty as possible), ``"sequential"`` (fill the GPUs in order); then the CPU, then the disk.
            None: load without dispatching.
        max_memory: device -> bytes or a size string, for the plans (the free memory of each device when None).
        no_split_module_classes: class names of blocks never split across devices (a transformers model's
            ``_no_split_modules``).
        offload_folder: the folder for the weights of blocks mapped to ``"disk"`` (needed when some are).
        offload_buffers: offload buffers with their blocks.
        dtype: load floating-point weights in this dtype.
        offload_state_dict: accepted for Accelerate's signature; the checkpoint is read tensor by tensor
            already, so there is no whole state dict to offload.
        skip_keys: keys of dict inputs and outputs that are not moved (e.g. ``"past_key_values"``).
        preload_module_classes: class names of modules whose whole weights are loaded before their forward.
        force_hooks: attach hooks even when the map names one device.
        strict: raise when the checkpoint and the model do not have the same keys (otherwise warn).
        full_state_dict: for models with DTensor parameters (see ``load_checkpoint_in_model``).
        broadcast_from_rank0: only the main process reads the files (see ``load_checkpoint_in_model``).

    Raises:
        ValueError: an unknown plan; a map that leaves a weight unassigned or names a device this machine
            lacks; ``"disk"`` without ``offload_folder``; a budget smaller than the largest unsplittable
            block; with ``strict``, missing or unexpected keys. All before any weight is read.

    Example:
        >>> with init_empty_weights():  # doctest: +SKIP
        ...     model = AutoModelForCausalLM.from_config(config)
        >>> model = load_checkpoint_and_dispatch(  # doctest: +SKIP
        ...     model, "out/model", device_map="auto", max_memory={"cpu": "2GiB"}, offload_folder="offload",
        ...     no_split_module_classes=model._no_split_modules, skip_keys="past_key_values",
        ... )
    """
    if isinstance(device_map, str):
        device_map = _plan(model, device_map, max_memory, no_split_module_classes, dtype, offload_buffers)
    if device_map is not None:
        _check_before_reading(model, device_map, offload_folder)
    load_checkpoint_in_model(
        model,
        checkpoint,
        device_map=device_map,
        offload_folder=offload_folder,
        dtype=dtype,
        offload_buffers=offload_buffers,
        strict=strict,
        full_state_dict=full_state_dict,
        broadcast_from_rank0=broadcast_from_rank0,
    )
    if device_map is None:
        return model
    return dispatch_model(
        model,
        device_map=device_map,
        offload_dir=offload_folder,
        offload_buffers=offload_buffers,
        skip_keys=skip_keys,
        preload_module_classes=preload_module_classes,
        force_hooks=force_hooks,
    )


def _check_before_reading(
    model: nn.Module, device_map: Mapping[str, Any], offload_folder: PathLike | None
) -> None:
    check_device_map(model, device_map)
    check_device_map_devices(device_map)
    disk = [name for name, device in device_map.items() if str(device) == "disk"]
    if disk and offload_folder is None:
        raise ValueError(
            f"load_checkpoint_and_dispatch(): the device_map sends {disk[:5]} to 'disk', and no offload_folder "
            "was given. Pass offload_folder= (a folder for the offloaded weights)."
        )
    if disk:
        os.makedirs(offload_folder, exist_ok=True)  # type: ignore[arg-type]
