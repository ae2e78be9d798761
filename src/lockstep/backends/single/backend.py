"""One process: nothing to wrap or synchronise."""

from __future__ import annotations

from typing import final

from torch import nn

from lockstep.backends.base import Backend
from lockstep.backends.capabilities import TrainingStateTransfer
from lockstep.backends.replicated_state import ReplicatedStateTransfer
from lockstep.config.enums import DistributedType


@final
class SingleProcessBackend(Backend):
    """A single process on one device."""

    distributed_type = DistributedType.NO
    capability_objects = {TrainingStateTransfer: ReplicatedStateTransfer}

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return model
