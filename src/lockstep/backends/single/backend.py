"""One process: nothing to wrap or synchronise."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, final

from torch import nn

from lockstep.backends.base import Backend
from lockstep.backends.capabilities import TrainingStateTransfer
from lockstep.config.enums import DistributedType


@final
class SingleProcessBackend(Backend, TrainingStateTransfer):
    """A single process on one device."""

    distributed_type = DistributedType.NO

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return model

    def training_state(self, models: Sequence[nn.Module], optimizers: Sequence[Any]) -> dict[str, Any]:
        from lockstep.backends.replicated_state import replicated_training_state

        return replicated_training_state(self, models, optimizers)

    def load_training_state(
        self, models: Sequence[nn.Module], optimizers: Sequence[Any], state: dict[str, Any]
    ) -> None:
        from lockstep.backends.replicated_state import load_replicated_training_state

        load_replicated_training_state(self, models, optimizers, state)
