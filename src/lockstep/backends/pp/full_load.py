"""A checkpoint saved without pipelining (``model.safetensors``, ``optimizer.bin``) loaded into pipeline stages.

Every pipeline rank reads the whole files itself and keeps the entries of the stages it holds (the
FSDP path, which broadcasts the main process's copy, expects every rank to hold every name).

``optimizer.bin`` is torch's ``Optimizer.state_dict()``: its parameters are numbered in the order of the
optimizer's ``param_groups`` as it was built. The pipeline backend records the names of those parameters
when it re-binds an optimizer to the stages (:func:`original_names`), which turns the numbers back into
the model's parameter names; each rank then restores the state of the parameters it holds.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def original_names(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[list[str]]:
    """The parameter names of each of ``optimizer``'s groups, before parameters are dropped or replaced
    (``names`` maps ``id(parameter)`` of the user's model to its name)."""
    return [[names.get(id(p), "") for p in group["params"]] for group in optimizer.param_groups]


def load_full_model(model: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Load this rank's entries of the whole model's ``full`` state dict into its stages."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    local = list(model.state_dict())
    missing = [key for key in local if key not in full]
    if missing:
        raise ValueError(
            f"The checkpoint's model files lack {len(missing)} of this pipeline rank's weights "
            f"(e.g. {missing[:5]}); load a checkpoint of the same model."
        )
    set_model_state_dict(
        model, {key: full[key] for key in local}, options=StateDictOptions(full_state_dict=True)
    )


def load_full_optimizer(
    model: nn.Module, optimizer: Any, saved: dict[str, Any], names: list[list[str]] | None
) -> None:
    """Restore the state of this rank's parameters from a whole ``optimizer.bin`` (``saved``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    groups = saved["param_groups"]
    if names is None or [len(g) for g in names] != [len(g["params"]) for g in groups]:
        raise ValueError(
            "The checkpoint's optimizer.bin numbers its parameters by the optimizer's groups as it was built, "
            "and this optimizer was not built the same way (other groups or parameter counts), so its state "
            "cannot be mapped onto the pipeline stages. Build the optimizer as in the run that saved it, "
            "before prepare()."
        )
    by_number = {
        number: name
        for group, group_names in zip(groups, names)
        for number, name in zip(group["params"], group_names)
    }
    here = {name for name, _ in model.named_parameters()}
    state = {by_number[n]: value for n, value in saved["state"].items() if by_number[n] in here}
    param_groups = [
        {**group, "params": [by_number[n] for n in group["params"] if by_number[n] in here]}
        for group in groups
    ]
    inner = getattr(optimizer, "optimizer", optimizer)
    set_optimizer_state_dict(
        model,
        inner,
        {"state": state, "param_groups": [g for g in param_groups if g["params"]]},
        options=StateDictOptions(full_state_dict=True),
    )
