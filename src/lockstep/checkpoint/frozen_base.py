"""Checkpoints of a peft model that leave its frozen base out: the adapter is saved, the base fingerprinted.

A peft model (LoRA) trains an adapter of a few MB on a base of many GB that does not change. ``save_state``
writes such a model's state without its frozen parameters (its trainable parameters and its buffers are kept,
with the optimizer and everything else as usual) and records, in ``frozen_base.json``, the keys it saved and a
fingerprint of the base it left out: each frozen parameter's name, shape and dtype, and the sum of the
absolute values and of the squares of its elements, accumulated in float64 over the whole tensor (a cheap
hash that does not depend on how the weights are sharded, so a checkpoint of N processes resumes on M).

``load_state`` checks, on every process, that the saved keys are exactly the model's trainable keys now and
that the fingerprint matches the model's base (names, shapes and dtypes exactly, the sums within a relative
``1e-6``), and refuses otherwise: an adapter loaded onto another base would resume something else. Then the
backend loads the saved keys and leaves the base as it is.

``ProjectConfiguration(save_frozen_base=True)`` saves the whole model instead, as Accelerate does.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lockstep.integrations.peft import is_peft_model

RECORD_FILE = "frozen_base.json"
RELATIVE_TOLERANCE = 1e-6
"""How far each fingerprint sum may differ (float64 sums of the same weights sharded another way)."""
_OPT_OUT = "save with ProjectConfiguration(save_frozen_base=True) to keep the whole model in the checkpoint"

Entry = dict[str, Any]
"""One model's record: ``{"saved": [keys], "frozen": {name: [shape, dtype, abs_sum, square_sum]}}``."""


def leaves_out_frozen(model: nn.Module) -> bool:
    """Whether ``save_state`` leaves the frozen parameters of ``model`` (unwrapped) out: a peft model with
    frozen and trainable parameters both."""
    if not is_peft_model(model):
        return False
    return {p.requires_grad for p in model.parameters()} == {True, False}


def frozen_names(model: nn.Module) -> set[str]:
    """The state-dict keys of the frozen parameters (every name of a tied one)."""
    return {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def kept_keys(model: nn.Module) -> list[str]:
    """The keys a checkpoint without the frozen base holds: trainable parameters and buffers."""
    frozen = frozen_names(model)
    return sorted(key for key in model.state_dict() if key not in frozen)


def without_frozen(state_dict: Mapping[str, Any], entry: Entry) -> dict[str, Any]:
    """``state_dict`` reduced to the keys ``entry`` saves (a main process's full state dict, or ``{}``)."""
    saved = set(entry["saved"])
    return {key: value for key, value in state_dict.items() if key in saved}


def _sums(tensor: torch.Tensor) -> tuple[float, float]:
    """(sum of |x|, sum of x^2) in float64; whole-tensor values for a sharded DTensor or a DeepSpeed ZeRO-3
    partition (a collective)."""
    from torch.distributed.tensor import DTensor

    if hasattr(tensor, "ds_tensor"):
        return _partition_sums(tensor)
    values = tensor.detach()
    if not values.is_floating_point():
        values = values.to(torch.float64)
    sums = [
        torch.linalg.vector_norm(values, 1, dtype=torch.float64),
        torch.linalg.vector_norm(values, 2, dtype=torch.float64),
    ]
    whole = [_summed_over_mesh(s) if isinstance(s, DTensor) else s for s in sums]
    return float(whole[0]), float(whole[1]) ** 2


def _summed_over_mesh(partial: Any) -> torch.Tensor:
    """The whole value of a norm of a sharded DTensor (a collective over its mesh). A shard offloaded to the
    CPU is moved to the mesh's device first: an NCCL group reduces no CPU tensor."""
    home = partial.device_mesh.device_type
    if partial.to_local().device.type != home:
        partial = partial.to(home)
    return partial.full_tensor()


def _partition_sums(parameter: Any) -> tuple[float, float]:
    """The sums of a ZeRO-3 parameter: every process holds a flat slice of it (the last one zero-padded),
    summed over its partition group."""
    import torch.distributed as dist

    local = parameter.ds_tensor.detach()
    if not local.is_floating_point():
        local = local.to(torch.float64)
    sums = torch.stack(
        [
            torch.linalg.vector_norm(local, 1, dtype=torch.float64),
            torch.linalg.vector_norm(local, 2, dtype=torch.float64) ** 2,
        ]
    )
    if dist.get_backend(parameter.ds_process_group) == "nccl" and sums.device.type == "cpu":
        sums = sums.cuda()  # a partition offloaded to the CPU (offload_param): NCCL reduces CUDA tensors only
    dist.all_reduce(sums, group=parameter.ds_process_group)
    return float(sums[0]), float(sums[1])


def fingerprint(model: nn.Module) -> dict[str, list[Any]]:
    """Each frozen parameter's ``[shape, dtype, sum of |x|, sum of x^2]`` by name (every process calls it
    together when the weights are sharded DTensors)."""
    prints: dict[str, list[Any]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if not parameter.requires_grad:
            abs_sum, square_sum = _sums(parameter)
            dtype = str(parameter.dtype).removeprefix("torch.")
            shape = getattr(parameter, "ds_shape", parameter.shape)  # a ZeRO-3 parameter's whole shape
            prints[name] = [list(shape), dtype, abs_sum, square_sum]
    return prints


def describe(models: Sequence[nn.Module]) -> dict[int, Entry]:
    """The record of each unwrapped model whose frozen base the checkpoint leaves out, by index (every
    process calls it together)."""
    return {
        index: {"saved": kept_keys(model), "frozen": fingerprint(model)}
        for index, model in enumerate(models)
        if leaves_out_frozen(model)
    }


def record_json(entries: Mapping[int, Entry]) -> dict[str, Any]:
    """What ``frozen_base.json`` holds."""
    return {"tolerance": RELATIVE_TOLERANCE, "models": {str(i): entry for i, entry in entries.items()}}


def read_record(folder: Path) -> dict[int, Entry]:
    """The models of checkpoint ``folder`` saved without their frozen base, by index ({} for none)."""
    path = Path(folder) / RECORD_FILE
    if not path.is_file():
        return {}
    return {int(index): entry for index, entry in json.loads(path.read_text())["models"].items()}


def saved_without_frozen(folder: Path, index: int) -> bool:
    """Whether model ``index`` of checkpoint ``folder`` was saved without its frozen base (it loads with
    ``strict=False``, after :func:`check`)."""
    return index in read_record(folder)


def check(folder: Path, models: Iterable[tuple[int, nn.Module]]) -> None:
    """Refuse to load checkpoint ``folder`` into ``models`` (``(index, unwrapped model)``) when a model saved
    without its frozen base does not have exactly the saved keys as its trainable ones, or has another base
    (every process calls it together: the fingerprint of sharded weights is a collective).

    Raises:
        ValueError: naming the checkpoint, the model and the first keys or base weights that differ.
    """
    record = read_record(folder)
    for index, model in models:
        if index in record:
            _check_keys(folder, index, record[index]["saved"], kept_keys(model))
            _check_base(folder, index, record[index]["frozen"], fingerprint(model))


def _check_keys(folder: Path, index: int, saved: list[str], expected: list[str]) -> None:
    if saved == expected:
        return
    missing = sorted(set(expected) - set(saved))
    extra = sorted(set(saved) - set(expected))
    raise ValueError(
        f"load_state({str(folder)!r}): model {index} was saved without its frozen base ({RECORD_FILE}: "
        f"{len(saved)} keys, the adapter), but those are not the trainable keys of the model prepared now "
        f"({len(expected)}). Trainable here, not in the checkpoint ({len(missing)}): {missing[:5]}; in the "
        f"checkpoint, frozen or absent here ({len(extra)}): {extra[:5]}. Load it into the same peft model it "
        "was saved from (the same base, LoraConfig, target modules and adapter name)."
    )


def _check_base(folder: Path, index: int, saved: dict[str, list[Any]], found: dict[str, list[Any]]) -> None:
    difference = _first_difference(saved, found)
    if difference is None:
        return
    raise ValueError(
        f"load_state({str(folder)!r}): model {index} was saved without its frozen base, and the base of the "
        f"model prepared now is not the one it was trained on: {difference}. The checkpoint holds only the "
        f"adapter: build the model from the same base weights before loading it, or {_OPT_OUT}."
    )


def _first_difference(saved: dict[str, list[Any]], found: dict[str, list[Any]]) -> str | None:
    if sorted(saved) != sorted(found):
        missing, extra = sorted(set(saved) - set(found)), sorted(set(found) - set(saved))
        return (
            f"{len(saved)} frozen parameters saved, {len(found)} here (not here: {missing[:3]}; "
            f"not in the checkpoint: {extra[:3]})"
        )
    for name in sorted(saved):
        (shape, dtype, *sums), (shape_now, dtype_now, *sums_now) = saved[name], found[name]
        if shape != shape_now or dtype != dtype_now:
            return f"{name} was {dtype} {shape}, is {dtype_now} {shape_now}"
        for what, before, now in zip(("absolute values", "squares"), sums, sums_now, strict=True):
            if abs(before - now) > RELATIVE_TOLERANCE * max(abs(before), abs(now), 1e-30):
                return f"the sum of the {what} of {name} was {before!r}, is {now!r}"
    return None
