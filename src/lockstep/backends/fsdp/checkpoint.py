"""The FSDP backend's checkpoint format: sharded (FSDP2) models and optimizers on ``torch.distributed.checkpoint``.

With ``SHARDED_STATE_DICT`` every process writes its own shards of model ``i`` into
``pytorch_model_fsdp_{i}/`` and of optimizer ``i`` into ``optimizer_{i}/`` (DCP's ``.distcp`` files plus
its ``.metadata``), inside the checkpoint's staging folder, so the manifest, the atomic rename and
rotation of :mod:`lockstep.checkpoint.layout` cover them. DCP records global shapes, so a checkpoint
saved by N processes loads on M (resharding needs no conversion step).

With ``FULL_STATE_DICT`` the model is gathered into ``model.safetensors`` and the optimizer into
``optimizer.bin`` on the main process (one full copy at a time, on the CPU), and loading sends every
process its shards from the main process.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

MODEL_FOLDER = "pytorch_model_fsdp_{index}"
OPTIMIZER_FOLDER = "optimizer_{index}"
DCP_METADATA = ".metadata"


def _options(*, full: bool, broadcast: bool = False) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full, cpu_offload=full, broadcast_from_rank0=broadcast)


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)


def _model(model: nn.Module) -> nn.Module:
    return getattr(model, "_orig_mod", model)


# -- full state dicts (FULL_STATE_DICT) ---------------------------------------------------------------
def full_optimizer_state(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """The optimizer's whole state, keyed by parameter name, on the main process ({} elsewhere)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(_model(model), _inner(optimizer), options=_options(full=True))


def load_full_model(model: nn.Module, state_dict: dict[str, torch.Tensor], *, distributed: bool) -> None:
    """Shard the main process's full ``state_dict`` into ``model`` (the others pass ``{}``)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(_model(model), state_dict, options=_options(full=True, broadcast=distributed))


def load_full_optimizer(
    model: nn.Module, optimizer: Any, state_dict: dict[str, Any], *, distributed: bool
) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(
        _model(model), _inner(optimizer), state_dict, options=_options(full=True, broadcast=distributed)
    )


# -- sharded state dicts (SHARDED_STATE_DICT) ---------------------------------------------------------
def save_sharded(
    models: Sequence[tuple[int, nn.Module]], optimizers: Sequence[tuple[int, nn.Module, Any]], folder: Path
) -> None:
    """Every process writes its shards of each model and optimizer into ``folder`` (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    for index, model in models:
        state = get_model_state_dict(_model(model))
        dcp.save(state, checkpoint_id=folder / MODEL_FOLDER.format(index=index))
    for index, model, optimizer in optimizers:
        state = get_optimizer_state_dict(_model(model), _inner(optimizer))
        dcp.save({"optimizer": state}, checkpoint_id=folder / OPTIMIZER_FOLDER.format(index=index))


def require_shards(path: Path, what: str) -> None:
    if not (path / DCP_METADATA).is_file():
        raise FileNotFoundError(
            f"{path.parent} has no sharded {what} ({path.name}/{DCP_METADATA} is missing). It was saved with a "
            "different number of models/optimizers or with state_dict_type FULL_STATE_DICT; prepare the same "
            "objects and use the same state_dict_type as when it was saved."
        )


def load_sharded(
    models: Sequence[tuple[int, nn.Module]], optimizers: Sequence[tuple[int, nn.Module, Any]], folder: Path
) -> None:
    """Read each process's shards back, whatever the number of processes that saved them (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    for index, model in models:
        path = folder / MODEL_FOLDER.format(index=index)
        require_shards(path, f"model {index}")
        state = get_model_state_dict(_model(model))
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(_model(model), state)
    for index, model, optimizer in optimizers:
        path = folder / OPTIMIZER_FOLDER.format(index=index)
        require_shards(path, f"optimizer {index}")
        holder = {"optimizer": get_optimizer_state_dict(_model(model), _inner(optimizer))}
        dcp.load(holder, checkpoint_id=path)
        set_optimizer_state_dict(_model(model), _inner(optimizer), holder["optimizer"])


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
    """Assemble every tensor of a DCP model folder in this one process (no process group needed)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(str(folder))
    metadata = reader.read_metadata()
    state: dict[str, torch.Tensor] = {
        key: torch.empty(item.size, dtype=item.properties.dtype)
        for key, item in metadata.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata)
    }
    if not state:
        raise ValueError(f"{folder} holds no tensors; it is not a model checkpoint.")
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state
