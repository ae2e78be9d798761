"""The whole training state of a replica that holds whole models (one process, DDP), in memory.

:class:`ReplicatedStateTransfer` is the :class:`~lockstep.backends.capabilities.TrainingStateTransfer` of
backends whose every process holds the full model and optimizer: a copy on the CPU that a peer can send,
and the load of one. Such a backend lists it in ``capability_objects``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, final

import torch
from torch import nn

from lockstep.backends.base import Backend
from lockstep.backends.capabilities import TrainingStateTransfer


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(item) for item in value)
    return value


def replicated_training_state(
    backend: Backend, models: Sequence[nn.Module], optimizers: Sequence[Any]
) -> dict[str, Any]:
    """Each model's weights and each optimizer's state, as CPU copies (the training goes on unchanged)."""
    return {
        "models": [_to_cpu(backend.unwrap_model(m, keep_torch_compile=False).state_dict()) for m in models],
        "optimizers": [_to_cpu(optimizer.state_dict()) for optimizer in optimizers],
    }


def load_replicated_training_state(
    backend: Backend, models: Sequence[nn.Module], optimizers: Sequence[Any], state: dict[str, Any]
) -> None:
    """Load a peer's :func:`replicated_training_state` into this replica's models and optimizers.

    Raises:
        ValueError: the state holds another number of models or optimizers than this replica.
    """
    given = (len(state.get("models", ())), len(state.get("optimizers", ())))
    if given != (len(models), len(optimizers)):
        raise ValueError(
            f"The training state holds {given[0]} model(s) and {given[1]} optimizer(s), but this replica prepared "
            f"{len(models)} and {len(optimizers)}: the peer that sent it trains another set-up."
        )
    for model, weights in zip(models, state["models"], strict=True):
        backend.unwrap_model(model, keep_torch_compile=False).load_state_dict(weights)
    for optimizer, optimizer_state in zip(optimizers, state["optimizers"], strict=True):
        optimizer.load_state_dict(optimizer_state)


@final
class ReplicatedStateTransfer(TrainingStateTransfer):
    """The training state of a backend whose processes each hold the whole model and optimizer.

    Args:
        backend: unwraps the prepared models.
    """

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def training_state(self, models: Sequence[nn.Module], optimizers: Sequence[Any]) -> dict[str, Any]:
        return replicated_training_state(self.backend, models, optimizers)

    def load_training_state(
        self, models: Sequence[nn.Module], optimizers: Sequence[Any], state: dict[str, Any]
    ) -> None:
        load_replicated_training_state(self.backend, models, optimizers, state)
