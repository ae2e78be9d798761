"""One model's whole fp32 weights from a DeepSpeed ZeRO checkpoint, in one process, without DeepSpeed.

``lockstep merge-weights`` reads the engine files ``save_state`` wrote (``deepspeed_N/engine/``) as
DeepSpeed's own ``zero_to_fp32`` does, but needs neither DeepSpeed nor a process group, and never unpickles
arbitrary objects: the files load with ``torch.load(weights_only=True)``, the three DeepSpeed classes they
mention (a loss scaler, an enum, a named tuple) standing in as inert records.

* ZeRO-0: the module's own state dict holds every weight.
* ZeRO-1/2: each process holds one slice of each parameter group's flat fp32 copy; the slices, joined in
  rank order, are the group's parameters one after the other (padding at the end).
* ZeRO-3: each process holds ``ceil(numel / world)`` elements of every parameter, in order; a parameter
  is its slices joined in rank order, cut to its size.

Buffers come from the module's state dict; tied parameters are written under each of their names.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lockstep.backends.deepspeed.checkpoint import ENGINE_FOLDER, TAG

_STAND_INS = (
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
_RANK = re.compile(r"zero_pp_rank_(\d+)_mp_rank_00_")


def _record_class(path: str) -> type:
    module, name = path.rsplit(".", 1)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __setstate__(self: Any, state: Any) -> None:
        self.state = state

    return type(
        name,
        (),
        {"__module__": module, "__qualname__": name, "__init__": __init__, "__setstate__": __setstate__},
    )


_RECORDS = [_record_class(path) for path in _STAND_INS]


def _load(path: Path) -> dict[str, Any]:
    with torch.serialization.safe_globals(_RECORDS):
        return torch.load(path, map_location="cpu", weights_only=True)


def engine_files_folder(checkpoint: Path, model_index: int = 0) -> Path:
    """The folder of DeepSpeed's files for model ``model_index``: ``checkpoint`` may be the ``save_state``
    folder, its ``deepspeed_N`` folder, or that folder's ``engine`` folder.

    Raises:
        FileNotFoundError: none of these holds DeepSpeed model-state files.
    """
    for candidate in (
        checkpoint / ENGINE_FOLDER.format(index=model_index) / TAG,
        checkpoint / TAG,
        checkpoint,
    ):
        if any(candidate.glob("*model_states.pt")):
            return candidate
    raise FileNotFoundError(
        f"{checkpoint} holds no DeepSpeed checkpoint (no *model_states.pt in it, in {TAG}/ or in "
        f"{ENGINE_FOLDER.format(index=model_index)}/{TAG}/)."
    )


def is_deepspeed_checkpoint(checkpoint: Path, model_index: int = 0) -> bool:
    try:
        engine_files_folder(checkpoint, model_index)
    except FileNotFoundError:
        return False
    return True


def _by_rank(folder: Path, suffix: str) -> list[Path]:
    files = [
        (int(match.group(1)), path)
        for path in folder.glob(f"*{suffix}")
        if (match := _RANK.search(path.name))
    ]
    return [path for _, path in sorted(files)]


def read_zero_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every weight of the model whose DeepSpeed files are in ``folder`` (see :func:`engine_files_folder`).

    Raises:
        FileNotFoundError: a process's optimizer-state file is missing.
        ValueError: the files disagree with the shapes they record.
    """
    ranked = _by_rank(folder, "_model_states.pt")
    model_states = _load(ranked[0] if ranked else folder / "mp_rank_00_model_states.pt")
    stage = int((model_states.get("ds_config") or {}).get("zero_optimization", {}).get("stage", 0))
    module: dict[str, torch.Tensor] = model_states["module"]
    weights = {name: module[name] for name in model_states.get("buffer_names", []) if name in module}
    if stage == 0:
        weights = dict(module)
    else:
        world = int(model_states["dp_world_size"])
        optimizer_files = _by_rank(folder, "_optim_states.pt")
        if len(optimizer_files) != world:
            raise FileNotFoundError(
                f"{folder} has {len(optimizer_files)} optimizer-state files for {world} processes; the checkpoint is "
                "incomplete."
            )
        partitions = [_load(path)["optimizer_state_dict"] for path in optimizer_files]
        merge: Callable[..., dict[str, torch.Tensor]] = _merge_zero3 if stage == 3 else _merge_zero12
        weights.update(merge(model_states["param_shapes"], partitions, world))
        weights.update(_frozen(model_states, stage, folder, module))
    for name, tied_to in (model_states.get("shared_params") or {}).items():
        weights[name] = weights[tied_to]
    return weights


def _merge_zero12(
    shapes: list[dict[str, torch.Size]], partitions: list[dict], world: int
) -> dict[str, torch.Tensor]:
    weights = {}
    for group, group_shapes in enumerate(shapes):
        flat = torch.cat([p["single_partition_of_fp32_groups"][group] for p in partitions])
        offset = 0
        for name, shape in group_shapes.items():
            numel = math.prod(shape)
            weights[name] = flat[offset : offset + numel].view(shape).clone()
            offset += numel
        if offset > flat.numel():
            raise ValueError(
                f"Parameter group {group} records {offset} elements, and its partitions hold {flat.numel()}."
            )
    return weights


def _merge_zero3(
    shapes: list[dict[str, torch.Size]], partitions: list[dict], world: int
) -> dict[str, torch.Tensor]:
    weights = {}
    for group, group_shapes in enumerate(shapes):
        flats = [p["fp32_flat_groups"][group] for p in partitions]
        offset = 0
        for name, shape in group_shapes.items():
            numel = math.prod(shape)
            part = math.ceil(numel / world)
            whole = torch.cat([flat[offset : offset + part] for flat in flats])[:numel]
            weights[name] = whole.view(shape).clone()
            offset += part
    return weights


def _frozen(
    model_states: dict, stage: int, folder: Path, module: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Parameters that were not trained (``requires_grad=False``): whole in the module below ZeRO-3, in
    per-process fragments under it."""
    shapes = model_states.get("frozen_param_shapes") or {}
    if stage < 3:
        return {name: module[name] for name in shapes if name in module}
    fragments = [
        _load(path).get("frozen_param_fragments") or {} for path in _by_rank(folder, "_model_states.pt")
    ]
    return {
        name: torch.cat([f[name].reshape(-1) for f in fragments])[: math.prod(shape)].view(shape).clone()
        for name, shape in shapes.items()
    }
