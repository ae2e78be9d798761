"""Planning where each block of a model goes under a memory budget: ``infer_auto_device_map`` and
``get_balanced_memory`` (:mod:`lockstep.utils.modeling`'s planners).

The plan reads only shapes and dtypes (a model built with ``init_empty_weights`` is enough). Blocks are
placed in the order the model declares them, filling the GPUs first, then the CPU, then the disk; a block
that does not fit is opened up into its children unless its class is listed in
``no_split_module_classes``. On the device the model executes on (the first GPU, or the CPU without one),
room for the largest unsplittable block is kept free, since every offloaded block is loaded there to run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from lockstep.utils._model_tensors import (
    compute_module_sizes,
    compute_module_total_buffer_size,
    device_for,
    find_tied_parameters,
    get_max_layer_size,
    get_max_memory,
)

__all__ = ["clean_device_map", "format_device_map", "get_balanced_memory", "infer_auto_device_map"]

Device = int | str
Entry = tuple[str, nn.Module | torch.Tensor]


def _ordered_devices(max_memory: Mapping[Device, int]) -> list[Device]:
    """GPU indices in order, then ``"mps"``, ``"cpu"`` and ``"disk"`` (always there: it has no limit)."""
    gpus = sorted(key for key in max_memory if isinstance(key, int))
    others = [key for key in ("mps", "cpu") if key in max_memory]
    return [*gpus, *others, "disk"]


def _top_level(model: nn.Module) -> list[Entry]:
    return [
        *model.named_parameters(recurse=False),
        *model.named_children(),
        *model.named_buffers(recurse=False),
    ]


def _children(name: str, module: nn.Module) -> list[Entry]:
    return [(f"{name}.{child}" if name else child, value) for child, value in _top_level(module)]


def _splittable(value: nn.Module | torch.Tensor, no_split: Sequence[str]) -> bool:
    """A module with children whose class may be split (a leaf such as ``nn.Linear`` is one block)."""
    return (
        isinstance(value, nn.Module)
        and type(value).__name__ not in no_split
        and next(value.named_children(), None) is not None
    )


@dataclass
class _Planner:
    """The state of one plan: the devices' budgets and what is placed so far."""

    devices: list[Device]
    budgets: dict[Device, int]
    sizes: Mapping[str, int]
    no_split: Sequence[str]
    reserved: dict[Device, int]
    plan: dict[str, Device] = field(default_factory=dict)
    used: dict[Device, int] = field(default_factory=dict)

    def place(self, pending: list[Entry]) -> dict[str, Device]:
        index = 0
        while pending:
            name, value = pending.pop(0)
            device = self.devices[index]
            size = self.sizes[name]
            room = self.budgets.get(device, 0) - self.reserved.get(device, 0) - self.used.get(device, 0)
            if device == "disk" or size <= room:
                self.plan[name] = device
                self.used[device] = self.used.get(device, 0) + size
            elif _splittable(value, self.no_split):
                pending[:0] = _children(name, value)  # type: ignore[arg-type]
            else:
                pending.insert(0, (name, value))
                index += 1  # this device is full for this block: the next one
        return self.plan


def _main_device(devices: Sequence[Device]) -> Device:
    return devices[0] if devices[0] != "disk" else "cpu"


def _reservations(
    model: nn.Module,
    sizes: Mapping[str, int],
    budgets: Mapping[Device, int],
    main: Device,
    no_split: Sequence[str],
    offload_buffers: bool,
) -> dict[Device, int]:
    """What stays free on the main device when the model does not fit there: room for the largest block
    (each offloaded block is loaded there to run) and, unless ``offload_buffers``, for the buffers."""
    if sizes[""] <= budgets.get(main, 0):
        return {}
    largest, names = get_max_layer_size(_top_level(model), sizes, no_split)
    budget = budgets.get(main, 0)
    if largest > budget:
        raise ValueError(
            f"infer_auto_device_map(): the largest block that cannot be split, {names[0]!r} "
            f"({_human(largest)}), does not fit in max_memory[{main!r}] = {_human(budget)}, the device every "
            f"offloaded block runs on. Give {main!r} at least {_human(largest)}, or split the block (take "
            "its class out of no_split_module_classes)."
        )
    buffers = 0 if offload_buffers else compute_module_total_buffer_size(model)
    return {main: largest + buffers}


def _keep_tied_together(model: nn.Module, plan: dict[str, Device]) -> None:
    """A module holding a weight tied to one placed earlier goes on that one's device (the tied weight is
    counted once, under its first name, so it costs only the module's other tensors)."""
    counted = {name for name, _ in model.named_parameters()}  # the first name of each tied weight
    for group in find_tied_parameters(model):
        first = next(name for name in group if name in counted)
        first_device = device_for(first, plan)
        for name in group:
            if name == first:
                continue
            owner = name.rpartition(".")[0]
            for key in (name, owner):
                if key in plan:
                    plan[key] = first_device


def clean_device_map(device_map: dict[str, Device], module_name: str = "") -> dict[str, Device]:
    """Merge the entries under ``module_name`` into one when they all name the same device (recursively).

    Example:
        >>> clean_device_map({"a.0": 0, "a.1": 0, "b": "cpu"})
        {'a': 0, 'b': 'cpu'}
    """
    prefix = f"{module_name}." if module_name else ""
    under = [key for key in device_map if key == module_name or key.startswith(prefix)]
    if len(under) > 1 and len({str(device_map[key]) for key in under}) == 1:
        merged = {}
        for key, device in device_map.items():  # the merged entry takes the place of the first one
            if key not in under:
                merged[key] = device
            elif key == under[0]:
                merged[module_name] = device
        device_map.clear()
        device_map.update(merged)
        return device_map
    children = {key[len(prefix) :].split(".")[0] for key in under if key != module_name}
    for child in sorted(children):
        clean_device_map(device_map, f"{prefix}{child}")
    return device_map


def _human(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def format_device_map(device_map: Mapping[str, Device], sizes: Mapping[str, int]) -> str:
    """The plan as a table: one row per entry (module, size, device), then the total per device.

    Example:
        >>> print(format_device_map({"0": "cpu", "1": "disk"}, {"0": 2048, "1": 512}))
        module | size     | device
        -------+----------+-------
        0      | 2.00 KiB | cpu
        1      | 512 B    | disk
        total on cpu: 2.00 KiB; on disk: 512 B
    """
    rows = [
        (name or "(whole model)", _human(sizes[name]), str(device)) for name, device in device_map.items()
    ]
    widths = [max(len(row[column]) for row in [("module", "size", "device"), *rows]) for column in range(3)]
    lines = [
        " | ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
        for row in [("module", "size", "device"), *rows]
    ]
    lines.insert(1, "-+-".join("-" * width for width in widths))
    totals: dict[str, int] = {}
    for name, device in device_map.items():
        totals[str(device)] = totals.get(str(device), 0) + sizes[name]
    lines.append("total " + "; ".join(f"on {device}: {_human(size)}" for device, size in totals.items()))
    return "\n".join(lines)


def infer_auto_device_map(
    model: nn.Module,
    max_memory: Mapping[Device, int | str] | None = None,
    no_split_module_classes: Sequence[str] | str | None = None,
    dtype: str | torch.dtype | None = None,
    special_dtypes: Mapping[str, str | torch.dtype] | None = None,
    verbose: bool = False,
    clean_result: bool = True,
    offload_buffers: bool = False,
    fallback_allocation: bool = False,
) -> dict[str, Device]:
    """A device map for ``model`` under ``max_memory``: GPUs first, then the CPU, then the disk.

    Args:
        model: the model (on the meta device too: only shapes and dtypes are read).
        max_memory: device -> bytes or a size string (``{0: "10GiB", "cpu": "30GiB"}``); the free memory
            of every device (:func:`get_max_memory`) when None. The disk has no limit.
        no_split_module_classes: class names of blocks never split across devices (e.g. the decoder layer,
            whose residual connections would otherwise cross devices).
        dtype: size floating-point weights as if loaded in this dtype.
        special_dtypes: per weight name, a dtype that overrides ``dtype``.
        verbose: print the plan as a table (module, size, device).
        clean_result: merge the entries of a module that all land on one device into one entry.
        offload_buffers: buffers are offloaded with their block (otherwise room for them is kept on the
            main device).
        fallback_allocation: accepted for Accelerate's signature; a block that fits nowhere goes to disk.

    Raises:
        ValueError: the device every offloaded block runs on cannot hold the largest unsplittable block
            (the message names it and its size).

    Example:
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])  # 1088 bytes each
        >>> infer_auto_device_map(model, max_memory={"cpu": 3000})
        {'0': 'cpu', '1': 'disk', '2': 'disk', '3': 'disk'}
    """
    budgets = get_max_memory(max_memory)
    no_split = (
        [no_split_module_classes]
        if isinstance(no_split_module_classes, str)
        else list(no_split_module_classes or [])
    )
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    devices = _ordered_devices(budgets)
    reserved = _reservations(model, sizes, budgets, _main_device(devices), no_split, offload_buffers)
    planner = _Planner(devices, dict(budgets), sizes, no_split, reserved)
    plan = planner.place(_top_level(model))
    _keep_tied_together(model, plan)
    if clean_result:
        plan = clean_device_map(plan)
    if verbose:
        print(format_device_map(plan, sizes))
    return plan


def get_balanced_memory(
    model: nn.Module,
    max_memory: Mapping[Device, int | str] | None = None,
    no_split_module_classes: Sequence[str] | str | None = None,
    dtype: str | torch.dtype | None = None,
    special_dtypes: Mapping[str, str | torch.dtype] | None = None,
    low_zero: bool = False,
) -> dict[Device, int]:
    """A ``max_memory`` that spreads ``model`` evenly over the GPUs, for :func:`infer_auto_device_map`.

    Each GPU but the last gets the model's size divided by the number of GPUs, plus room for the largest
    unsplittable block and for an average leaf module (capped at what the GPU has); the last GPU, the CPU and
    the disk keep their whole budget. With fewer than two GPUs the budget is returned as it is.

    Args:
        model: the model (on the meta device too).
        max_memory: device -> bytes or a size string; the free memory of every device when None.
        no_split_module_classes: class names of blocks never split across devices.
        dtype: size floating-point weights as if loaded in this dtype.
        special_dtypes: per weight name, a dtype that overrides ``dtype``.
        low_zero: put as little as possible on GPU 0 (``"balanced_low_0"``), keeping it free for the
            work done outside the model (``generate``'s logits processing).

    Example:
        >>> get_balanced_memory(torch.nn.Linear(4, 4), max_memory={"cpu": "1GiB"})
        {'cpu': 1073741824}
    """
    budgets = get_max_memory(max_memory)
    gpus = sorted(key for key in budgets if isinstance(key, int) and budgets[key] > 0)
    if len(gpus) < 2 or (low_zero and len(gpus) < 3):
        return budgets
    no_split = (
        [no_split_module_classes]
        if isinstance(no_split_module_classes, str)
        else list(no_split_module_classes or [])
    )
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    sharing = gpus[1:] if low_zero else gpus
    per_gpu = sizes[""] // len(sharing)
    leaves = [name for name, module in model.named_modules() if name and not list(module.children())]
    mean_leaf = sum(sizes[name] for name in leaves) // max(len(leaves), 1)
    largest, _ = get_max_layer_size(_top_level(model), sizes, no_split)
    per_gpu += max(mean_leaf, largest)
    balanced = dict(budgets)
    for gpu in sharing[:-1]:
        balanced[gpu] = min(budgets[gpu], per_gpu)
    if low_zero:
        balanced[gpus[0]] = min(budgets[gpus[0]], largest)
    return balanced
