"""The one place that decides which backend distributes the model."""

from __future__ import annotations

from lockstep.backends.base import Backend
from lockstep.backends.ddp import DDPBackend
from lockstep.backends.single import SingleProcessBackend
from lockstep.config.kwargs import DistributedDataParallelKwargs
from lockstep.config.plugins import TorchDynamoPlugin
from lockstep.state import PartialState


def select_backend(
    state: PartialState,
    *,
    ddp_kwargs: DistributedDataParallelKwargs | None = None,
    dynamo_plugin: TorchDynamoPlugin | None = None,
) -> Backend:
    """Pick the backend for this process's topology and the user's plugins."""
    if state.num_processes > 1:
        return DDPBackend(state, ddp_kwargs=ddp_kwargs, dynamo_plugin=dynamo_plugin)
    return SingleProcessBackend(state, dynamo_plugin=dynamo_plugin)
