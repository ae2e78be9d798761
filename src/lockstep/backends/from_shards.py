"""Sharded checkpoints loaded into a model that is not sharded (one process, DDP).

A ``save_state`` folder written by FSDP (``SHARDED_STATE_DICT``) or by pipeline parallelism holds model
``i`` in ``pytorch_model_fsdp_{i}/`` and optimizer ``i`` in ``optimizer_{i}/`` (``torch.distributed.checkpoint``
folders) instead of ``model.safetensors`` and ``optimizer.bin``. DCP records every tensor's global name and
shape, and those names are the model's own (a pipeline stage exposes ``layers.3.up.weight``, not torch's
``submod_1`` names), so a backend without shards reads such a folder whole, in each process, with no
process group, and restores:

* the weights, with ``load_state_dict(strict=True)`` (bit for bit what the stages held);
* the optimizer state, keyed by parameter name: the nested form FSDP writes, or the flattened form of a
  pipelined model (``state.<name>.exp_avg``, ``param_groups.<name>.lr``), through torch's
  ``set_optimizer_state_dict``, which maps names to this optimizer's parameters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

MODEL_FOLDER = "pytorch_model_fsdp_{index}"
OPTIMIZER_FOLDER = "optimizer_{index}"
_METADATA = ".metadata"


def model_shards(folder: Path, index: int) -> Path | None:
    """Model ``index``'s DCP folder inside the checkpoint ``folder``, or None."""
    path = folder / MODEL_FOLDER.format(index=index)
    return path if (path / _METADATA).is_file() else None


def optimizer_shards(folder: Path, index: int) -> Path | None:
    """Optimizer ``index``'s DCP folder inside the checkpoint ``folder``, or None."""
    path = folder / OPTIMIZER_FOLDER.format(index=index)
    return path if (path / _METADATA).is_file() else None


def read_whole(folder: Path) -> dict[str, Any]:
    """Everything a DCP folder holds, assembled in this one process (no process group), nested again as it
    was saved (``{"model": {...}}``, ``{"optimizer": {...}}``)."""
    import torch
    from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from lockstep.checkpoint import safe_dcp

    metadata = safe_dcp.read_metadata(folder)
    flat: dict[str, Any] = {
        key: torch.empty(item.size, dtype=item.properties.dtype)
        if isinstance(item, TensorStorageMetadata)
        else None  # a non-tensor value: DCP replaces the placeholder with what it reads
        for key, item in metadata.state_dict_metadata.items()
    }
    safe_dcp.load(flat, folder, no_dist=True)
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    if not all(key in paths for key in flat):
        return flat
    return unflatten_state_dict(flat, paths)


def load_model(model: nn.Module, folder: Path, *, frozen_left_out: bool = False) -> None:
    """Load the DCP model folder ``folder`` into the unsharded ``model`` (every key must match: every key
    but the frozen parameters' with ``frozen_left_out``, a peft model's adapter)."""
    from lockstep.checkpoint.frozen_base import kept_keys

    saved = read_whole(folder)
    weights = saved.get("model", saved)
    expected = kept_keys(model) if frozen_left_out else model.state_dict().keys()
    missing = [key for key in expected if key not in weights]
    unexpected = [key for key in weights if key not in expected]
    if missing or unexpected:
        raise ValueError(
            f"{folder} does not hold {type(model).__name__}'s weights. Missing from it ({len(missing)}): "
            f"{missing[:10]}. Unknown to the model ({len(unexpected)}): {unexpected[:10]}. Load it into the "
            "model it was saved from, with the models prepared in the same order."
        )
    model.load_state_dict(weights, strict=not frozen_left_out)


def load_optimizer(model: nn.Module, optimizer: Any, folder: Path) -> None:
    """Load the DCP optimizer folder ``folder`` into ``optimizer``, whose parameters belong to ``model``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    saved = read_whole(folder)
    state = saved.get("optimizer", saved)
    flattened = not ("state" in state and "param_groups" in state)
    inner = getattr(optimizer, "optimizer", optimizer)
    set_optimizer_state_dict(
        model, inner, state, options=StateDictOptions(flatten_optimizer_state_dict=flattened)
    )
