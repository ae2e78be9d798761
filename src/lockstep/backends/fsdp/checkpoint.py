"""The FSDP backend's checkpoint format: sharded (FSDP2) models and optimizers on ``torch.distributed.checkpoint``.

With ``SHARDED_STATE_DICT`` every process writes its own shards of model ``i`` into
``pytorch_model_fsdp_{i}/`` and of optimizer ``i`` into ``optimizer_{i}/`` (DCP's ``.distcp`` files plus
its ``.metadata``), inside the checkpoint's staging folder, so the manifest, the atomic rename and
rotation of :mod:`lockstep.checkpoint.layout` cover them. The folders hold ``{"model": state_dict}`` and
``{"optimizer": state_dict}`` (parameters named by their fully qualified names): the names and keys
Accelerate's ``save_fsdp_model``/``save_fsdp_optimizer`` write, so each side reads the other's shards.
DCP records global shapes, so a checkpoint saved by N processes loads on M (resharding needs no
conversion step).

With ``FULL_STATE_DICT`` the model is gathered into ``model.safetensors`` and the optimizer into
``optimizer.bin`` on the main process (one full copy at a time, on the CPU), and loading sends every
process its shards from the main process.

Loading follows what the folder holds, whatever ``state_dict_type`` is set now: shards, lockstep's model
files, or Accelerate's ``pytorch_model_fsdp.bin``. DCP folders are read without unpickling arbitrary objects
(:mod:`lockstep.checkpoint.safe_dcp`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lockstep.checkpoint.model_files import load_model_files
from lockstep.checkpoint.safe_load import safe_torch_load
from lockstep.checkpoint.training_state import accelerate_fsdp_model_file, find_model_weights, indexed

MODEL_FOLDER = "pytorch_model_fsdp_{index}"
OPTIMIZER_FOLDER = "optimizer_{index}"
DCP_METADATA = ".metadata"
MODEL_KEY = "model"
"""The top-level key Accelerate saves a model's sharded state dict under."""
OPTIMIZER_KEY = "optimizer"
"""The top-level key Accelerate (and lockstep) save an optimizer's sharded state dict under."""


def _options(*, full: bool, broadcast: bool = False) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full, cpu_offload=full, broadcast_from_rank0=broadcast)


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer under the wrappers (the prepared optimizer, a fault-tolerant group's quorum step):
    torch's state-dict helpers may step it once to create its state, which must not be a training step."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def _model(model: nn.Module) -> nn.Module:
    return getattr(model, "_orig_mod", model)


def _sharded_optimizer_options(model: nn.Module) -> Any:
    """A pipelined model's optimizer state is saved flattened (``param_groups.<name>.lr``, one entry per
    parameter): each pipeline rank holds other parameters, and one ``param_groups`` list per rank would
    collide under one DCP key (only one rank's list would be kept)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=getattr(model, "flat_optimizer_state", False))


# -- full state dicts (FULL_STATE_DICT) ---------------------------------------------------------------
def full_optimizer_state(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """The optimizer's whole state, keyed by parameter name, on the main process ({} elsewhere)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(_model(model), _inner(optimizer), options=_options(full=True))


def load_full_model(model: nn.Module, state_dict: dict[str, torch.Tensor], *, distributed: bool) -> Any:
    """Shard the main process's full ``state_dict`` into ``model`` (the others pass ``{}``); returns the
    missing and unexpected keys."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    state_dict = dict(state_dict)  # the caller's dict keeps its keys: the reshaped ones are taken out below
    reshaped = _broadcast_reshaped(_model(model), state_dict) if distributed else {}
    if not reshaped:
        return set_model_state_dict(
            _model(model), state_dict, options=_options(full=True, broadcast=distributed)
        )
    options = _options(full=True, broadcast=distributed)
    options.strict = False
    result = set_model_state_dict(_model(model), state_dict, options=options)
    _model(model).load_state_dict(reshaped, strict=False)
    missing = [key for key in result.missing_keys if key not in reshaped]
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"Error(s) in loading state_dict: missing keys {missing}, unexpected keys {result.unexpected_keys}."
        )
    return result


def _broadcast_reshaped(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The main process's saved tensors whose shape is not their parameter's (global) shape, broadcast whole
    to every process and taken out of its ``state_dict`` (a collective). torch's ``set_model_state_dict``
    would cut them as the parameter's mesh says and fail; ``load_state_dict`` gives them to the model's own
    load pre-hooks (expert parallelism's take this process's experts out of all of them)."""
    import torch.distributed as dist

    from lockstep.collectives import broadcast_object_list

    params = dict(model.named_parameters())
    odd = [
        (key, tuple(value.shape), value.dtype)
        for key, value in state_dict.items()
        if key in params
        and isinstance(value, torch.Tensor)
        and tuple(value.shape) != tuple(params[key].shape)
    ]
    odd = broadcast_object_list([odd], from_process=0)[0]
    reshaped = {}
    for key, shape, dtype in odd:
        device = params[key].device
        saved = state_dict.pop(key, None)
        tensor = (
            torch.empty(shape, dtype=dtype, device=device) if saved is None else saved.to(device).contiguous()
        )
        dist.broadcast(tensor, src=0)
        reshaped[key] = tensor
    return reshaped


def load_full_optimizer(
    model: nn.Module, optimizer: Any, state_dict: dict[str, Any], *, distributed: bool
) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    state_dict = by_name(_model(model), _inner(optimizer), state_dict)
    set_optimizer_state_dict(
        _model(model), _inner(optimizer), state_dict, options=_options(full=True, broadcast=distributed)
    )


def by_name(model: nn.Module, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` keyed by parameter name, as FSDP's full optimizer state is. torch's own format (one
    process and DDP write it: parameters numbered in the optimizer's order) is renamed after this optimizer's
    parameters, group by group (torch's ``set_optimizer_state_dict`` would keep the numbers, matching none).

    Raises:
        ValueError: when the groups do not hold as many parameters as the saved ones.
    """
    groups = state_dict.get("param_groups") or []
    if not any(isinstance(number, int) for group in groups for number in group["params"]):
        return state_dict
    sizes, expected = [len(g["params"]) for g in groups], [len(g["params"]) for g in optimizer.param_groups]
    if sizes != expected:
        raise ValueError(
            f"The saved optimizer state has parameter groups of {sizes} parameters; the optimizer prepared now "
            f"has {expected}. Build the optimizer over the same parameters, in the same order, as when it was saved."
        )
    names = {id(p): name for name, p in model.named_parameters()}
    renamed = {
        number: names[id(p)]
        for saved, group in zip(groups, optimizer.param_groups, strict=True)
        for number, p in zip(saved["params"], group["params"], strict=True)
    }
    return {
        "state": {renamed[number]: value for number, value in state_dict["state"].items()},
        "param_groups": [{**g, "params": [renamed[n] for n in g["params"]]} for g in groups],
    }


# -- sharded state dicts (SHARDED_STATE_DICT) ---------------------------------------------------------
def _model_state(model: nn.Module, *, frozen_left_out: bool) -> dict[str, Any]:
    """``model``'s sharded state dict (no communication); without its frozen parameters with
    ``frozen_left_out`` (:mod:`lockstep.checkpoint.frozen_base`)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from lockstep.checkpoint.frozen_base import frozen_names

    state = get_model_state_dict(_model(model))
    if not frozen_left_out:
        return state
    frozen = frozen_names(_model(model))
    return {key: value for key, value in state.items() if key not in frozen}


def save_model_shards(model: nn.Module, path: Path, *, frozen_left_out: bool = False) -> None:
    """Every process writes its shards of ``model`` into the DCP folder ``path`` (a collective); without its
    frozen parameters with ``frozen_left_out``."""
    import torch.distributed.checkpoint as dcp

    dcp.save({MODEL_KEY: _model_state(model, frozen_left_out=frozen_left_out)}, checkpoint_id=path)


def save_optimizer_shards(model: nn.Module, optimizer: Any, path: Path) -> None:
    """Every process writes its shards of ``optimizer``'s state into ``path`` (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(
        _model(model), _inner(optimizer), options=_sharded_optimizer_options(model)
    )
    dcp.save({OPTIMIZER_KEY: state}, checkpoint_id=path)


def save_sharded(
    models: Sequence[tuple[int, nn.Module]],
    optimizers: Sequence[tuple[int, nn.Module, Any]],
    folder: Path,
    *,
    frozen_left_out: Collection[int] = (),
) -> None:
    """Every process writes its shards of each model and optimizer into ``folder`` (a collective); the
    models whose index is in ``frozen_left_out`` without their frozen parameters."""
    for index, model in models:
        path = folder / MODEL_FOLDER.format(index=index)
        save_model_shards(model, path, frozen_left_out=index in frozen_left_out)
    for index, model, optimizer in optimizers:
        save_optimizer_shards(model, optimizer, folder / OPTIMIZER_FOLDER.format(index=index))


def _model_holder(state: dict[str, Any], path: Path) -> dict[str, Any]:
    """``state`` nested as the DCP folder ``path`` stores it: under ``"model"`` (Accelerate's layout, and
    lockstep's since it writes it) or at the top (lockstep checkpoints written before)."""
    from lockstep.checkpoint import safe_dcp

    stored = set(safe_dcp.read_metadata(path).state_dict_metadata)
    if all(f"{MODEL_KEY}.{key}" in stored for key in state):
        return {MODEL_KEY: state}
    if all(key in stored for key in state):
        return state
    missing = sorted(key for key in state if f"{MODEL_KEY}.{key}" not in stored)
    raise ValueError(
        f"{path} does not hold this model's weights: {len(missing)} of its {len(state)} keys are not in it "
        f"(e.g. {missing[0]!r}; the folder holds {sorted(stored)[:3]}...). Load it into the model it was saved "
        "from, with the models prepared in the same order."
    )


def load_model_shards(model: nn.Module, path: Path, *, frozen_left_out: bool = False) -> Any:
    """Read ``model``'s shards back from ``path``, whatever the number of processes that wrote them (a
    collective); returns the missing and unexpected keys. With ``frozen_left_out`` the folder holds all but
    the frozen parameters, which keep their values."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from lockstep.checkpoint import safe_dcp

    state = _model_state(model, frozen_left_out=frozen_left_out)
    safe_dcp.load(_model_holder(state, path), path)
    return set_model_state_dict(_model(model), state, options=StateDictOptions(strict=not frozen_left_out))


def load_optimizer_shards(model: nn.Module, optimizer: Any, path: Path) -> None:
    """Read ``optimizer``'s shards back from ``path`` (a collective)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    from lockstep.checkpoint import safe_dcp

    options = _sharded_optimizer_options(model)
    holder = {OPTIMIZER_KEY: get_optimizer_state_dict(_model(model), _inner(optimizer), options=options)}
    safe_dcp.load(holder, path)
    set_optimizer_state_dict(_model(model), _inner(optimizer), holder[OPTIMIZER_KEY], options=options)


# -- the adapters of a peft model (Accelerate's adapter_only=True) -----------------------------------
def save_adapter_shards(model: nn.Module, path: Path) -> None:
    """Every process writes its shards of the active adapter, under peft's names, into ``path`` (a collective)."""
    import torch.distributed.checkpoint as dcp

    from lockstep.integrations.peft import adapter_state_dict

    dcp.save({MODEL_KEY: adapter_state_dict(_model(model))}, checkpoint_id=path)


def load_adapter_shards(model: nn.Module, path: Path) -> Any:
    """Read the adapter's shards back from ``path`` into the active adapter (a collective); returns peft's
    load result (its missing keys are the frozen base's)."""
    from lockstep.checkpoint import safe_dcp
    from lockstep.integrations.peft import adapter_state_dict, load_adapter_state_dict

    state = adapter_state_dict(_model(model))
    safe_dcp.load(_model_holder(state, path), path)
    return load_adapter_state_dict(_model(model), state)


def full_trainable_state(model: nn.Module, *, distributed: bool) -> dict[str, torch.Tensor]:
    """The trainable parameters (the adapters of a peft model), whole, under the model's own names, on the
    main process ({} elsewhere when ``distributed``): the frozen base is left out."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=distributed, ignore_frozen_params=True)
    return get_model_state_dict(_model(model), options=options)


def load_full_trainable(model: nn.Module, state_dict: dict[str, torch.Tensor], *, distributed: bool) -> Any:
    """Shard the main process's :func:`full_trainable_state` into ``model``; the frozen base is untouched."""
    from dataclasses import replace

    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    options = replace(_options(full=True, broadcast=distributed), strict=False)
    return set_model_state_dict(_model(model), state_dict, options=options)


# -- what a folder holds ------------------------------------------------------------------------------
SHARDS, FULL = "shards", "full"


@dataclass
class FolderContents:
    """How each sharded model and optimizer is stored in a checkpoint folder, and what the main process read.

    ``models`` and ``optimizers`` map an index to ``"shards"`` (a DCP folder, read by every process together)
    or ``"full"`` (a whole state dict, read by the main process into ``full_models``/``full_optimizers``).
    """

    folder: Path
    models: dict[int, str] = field(default_factory=dict)
    optimizers: dict[int, str] = field(default_factory=dict)
    full_models: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    full_optimizers: dict[int, Any] = field(default_factory=dict)


def _has_shards(path: Path) -> bool:
    return (path / DCP_METADATA).is_file()


def read_contents(folder: Path, models: Sequence[int], optimizers: Sequence[int]) -> FolderContents:
    """Find each model's and optimizer's state in ``folder`` and read the whole ones (main process).

    Sharded folders are checked here (their metadata and non-tensor values load safely), so that a bad
    folder fails before the collective load.

    Raises:
        FileNotFoundError: a model or optimizer has no state in ``folder``.
        UnsafeCheckpointError: a file carries arbitrary Python objects (they are not run).
    """
    from lockstep.checkpoint import safe_dcp

    contents = FolderContents(folder)
    for index in models:
        shards = folder / MODEL_FOLDER.format(index=index)
        weights = find_model_weights(folder, index)
        if _has_shards(shards):
            safe_dcp.check_folder(shards)
            contents.models[index] = SHARDS
        elif weights is not None:
            contents.models[index] = FULL
            contents.full_models[index] = load_model_files(weights)
        else:
            raise FileNotFoundError(
                f"{folder} holds no weights for model {index}: neither {shards.name}/{DCP_METADATA} (sharded) nor "
                f"model files (model.safetensors, pytorch_model.bin, {accelerate_fsdp_model_file(index)}) exist. "
                "Prepare the same models, in the same order, as when it was saved."
            )
    for index in optimizers:
        shards, whole = (
            folder / OPTIMIZER_FOLDER.format(index=index),
            folder / indexed("optimizer", index, ".bin"),
        )
        if _has_shards(shards):
            safe_dcp.check_folder(shards)
            contents.optimizers[index] = SHARDS
        elif whole.is_file():
            contents.optimizers[index] = FULL
            contents.full_optimizers[index] = safe_torch_load(whole)
        else:
            raise FileNotFoundError(
                f"{folder} holds no state for optimizer {index}: neither {shards.name}/{DCP_METADATA} (sharded) "
                f"nor {whole.name} exists. Prepare the same optimizers, in the same order, as when it was saved."
            )
    return contents


def load_contents(
    contents: FolderContents,
    models: Sequence[tuple[int, nn.Module]],
    optimizers: Sequence[tuple[int, nn.Module, Any]],
    *,
    distributed: bool,
) -> None:
    """Restore every model and optimizer as ``contents`` says (a collective; every process passes the same
    ``models``/``optimizers`` maps, and the main process the full state dicts it read)."""
    from lockstep.checkpoint.frozen_base import saved_without_frozen

    folder = contents.folder
    for index, model in models:
        adapter_only = saved_without_frozen(folder, index)  # its keys were checked before (load_state)
        if contents.models[index] == SHARDS:
            load_model_shards(model, folder / MODEL_FOLDER.format(index=index), frozen_left_out=adapter_only)
        elif adapter_only:
            load_full_trainable(model, contents.full_models.get(index, {}), distributed=distributed)
        else:
            load_full_model(model, contents.full_models.get(index, {}), distributed=distributed)
    for index, model, optimizer in optimizers:
        if contents.optimizers[index] == SHARDS:
            load_optimizer_shards(model, optimizer, folder / OPTIMIZER_FOLDER.format(index=index))
        else:
            state = contents.full_optimizers.get(index, {})
            load_full_optimizer(model, optimizer, state, distributed=distributed)


# -- merging without a process group --------------------------------------------------------------
def sharded_model_folder(checkpoint: Path, index: int = 0) -> Path:
    """The DCP folder of model ``index`` inside a checkpoint (or ``checkpoint`` itself if it is one)."""
    if (checkpoint / DCP_METADATA).is_file():
        return checkpoint
    folder = checkpoint / MODEL_FOLDER.format(index=index)
    if not (folder / DCP_METADATA).is_file():
        raise FileNotFoundError(
            f"{checkpoint} is not a sharded checkpoint: neither {checkpoint / DCP_METADATA} nor "
            f"{folder / DCP_METADATA} exists. Pass a folder written by save_state with FSDP "
            "(state_dict_type SHARDED_STATE_DICT), or its pytorch_model_fsdp_N subfolder."
        )
    return folder


def read_full_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Assemble every tensor of a DCP model folder in this one process (no process group needed), named as
    in the model (without the ``"model"`` level Accelerate's layout adds)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from lockstep.checkpoint import safe_dcp

    metadata = safe_dcp.read_metadata(folder)
    state: dict[str, torch.Tensor] = {
        key: torch.empty(item.size, dtype=item.properties.dtype)
        for key, item in metadata.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata)
    }
    if not state:
        raise ValueError(f"{folder} holds no tensors; it is not a model checkpoint.")
    safe_dcp.load(state, folder, no_dist=True)
    # DCP records the nesting it flattened: ("model", "layers.0.weight") for {"model": {"layers.0.weight": t}}.
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    nested = [paths.get(key) for key in state]
    if all(isinstance(p, tuple) and len(p) == 2 and p[0] == MODEL_KEY for p in nested):
        return {path[1]: tensor for path, tensor in zip(nested, state.values(), strict=True)}  # type: ignore[index]
    return state
