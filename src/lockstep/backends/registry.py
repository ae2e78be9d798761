"""The one place that decides which backend distributes the model."""

from __future__ import annotations

from lockstep.backends.base import Backend
from lockstep.backends.ddp import DDPBackend
from lockstep.backends.single import SingleProcessBackend
from lockstep.config.fsdp import FullyShardedDataParallelPlugin
from lockstep.config.kwargs import DistributedDataParallelKwargs
from lockstep.config.plugins import TorchDynamoPlugin
from lockstep.state import PartialState


def select_backend(
    state: PartialState,
    *,
    ddp_kwargs: DistributedDataParallelKwargs | None = None,
    dynamo_plugin: TorchDynamoPlugin | None = None,
    fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
    mixed_precision: str = "no",
) -> Backend:
    """Pick the backend for this process's topology and the user's plugins.

    FSDP is used whenever its plugin is given, even with one process (a mesh of one), so that
    checkpoints have the same sharded format whatever the number of processes.
    """
    if fsdp_plugin is not None:
        from lockstep.backends.fsdp import FSDPBackend

        return FSDPBackend(
            state, plugin=fsdp_plugin, mixed_precision=mixed_precision, dynamo_plugin=dynamo_plugin
        )
    if state.num_processes > 1:
        return DDPBackend(state, ddp_kwargs=ddp_kwargs, dynamo_plugin=dynamo_plugin)
    return SingleProcessBackend(state, dynamo_plugin=dynamo_plugin)
