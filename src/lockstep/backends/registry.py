"""The one place that decides which backend distributes the model, and builds it with its precision.

Adding a backend means adding its folder under ``backends/`` and one branch here; nothing else in
lockstep asks which backend is active.
"""

from __future__ import annotations

from typing import Any

from lockstep.backends.base import Backend
from lockstep.backends.ddp import DDPBackend
from lockstep.backends.single import SingleProcessBackend
from lockstep.config.enums import PrecisionType
from lockstep.config.fsdp import FullyShardedDataParallelPlugin
from lockstep.config.kwargs import AutocastKwargs, DistributedDataParallelKwargs, GradScalerKwargs
from lockstep.config.parallelism import ParallelismConfig
from lockstep.config.plugins import TorchDynamoPlugin
from lockstep.precision import Precision
from lockstep.state import PartialState


def select_backend(
    state: PartialState,
    *,
    mixed_precision: PrecisionType = PrecisionType.NO,
    autocast_kwargs: AutocastKwargs | None = None,
    scaler_kwargs: GradScalerKwargs | None = None,
    ddp_kwargs: DistributedDataParallelKwargs | None = None,
    dynamo_plugin: TorchDynamoPlugin | None = None,
    fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
    deepspeed_plugins: dict[str, Any] | None = None,
    parallelism_config: ParallelismConfig | None = None,
) -> Backend:
    """Pick the backend for this process's topology and the user's plugins, with its precision.

    DeepSpeed is used whenever a plugin is given, even with one process (DeepSpeed's engine with a group of
    one). FSDP is used whenever its plugin is given, even with one process (a mesh of one), so that
    checkpoints have the same sharded format whatever the number of processes. A ``ParallelismConfig`` with
    a tensor, context or sharded data-parallel dimension gets the N-D backend (its FSDP settings from the
    plugin when one is given), one with a pipeline dimension the pipeline backend; one with ``dp_replicate`` alone is plain data parallelism (DDP).

    Example:
        >>> from lockstep.state import PartialState
        >>> type(select_backend(PartialState(cpu=True))).__name__
        'SingleProcessBackend'
    """
    precision_kwargs = {"autocast_kwargs": autocast_kwargs, "scaler_kwargs": scaler_kwargs}
    if deepspeed_plugins:
        from lockstep.backends.deepspeed.backend import DeepSpeedBackend

        return DeepSpeedBackend(
            state, plugins=deepspeed_plugins, mixed_precision=mixed_precision, dynamo_plugin=dynamo_plugin
        )
    if parallelism_config is not None and parallelism_config.device_mesh is not None:
        if parallelism_config.pp_enabled:
            from lockstep.backends.fsdp.precision import FSDPPrecision
            from lockstep.backends.pp import PipelineBackend

            return PipelineBackend(
                state,
                config=parallelism_config,
                plugin=fsdp_plugin if fsdp_plugin is not None else FullyShardedDataParallelPlugin(),
                precision=FSDPPrecision(mixed_precision, state.device, **precision_kwargs),
                dynamo_plugin=dynamo_plugin,
            )
        if parallelism_config.dp_shard_cp_dim_names or parallelism_config.tp_enabled:
            from lockstep.backends.fsdp.precision import FSDPPrecision
            from lockstep.backends.nd import NDParallelBackend

            return NDParallelBackend(
                state,
                config=parallelism_config,
                plugin=fsdp_plugin if fsdp_plugin is not None else FullyShardedDataParallelPlugin(),
                precision=FSDPPrecision(mixed_precision, state.device, **precision_kwargs),
                dynamo_plugin=dynamo_plugin,
            )
        if fsdp_plugin is not None:
            raise ValueError(
                f"ParallelismConfig(dp_replicate_size={parallelism_config.dp_replicate_size}) alone means plain data "
                "parallelism, but an FSDP plugin was given: set dp_shard_size instead to shard the model."
            )
    if fsdp_plugin is not None:
        from lockstep.backends.fsdp import FSDPBackend
        from lockstep.backends.fsdp.precision import FSDPPrecision

        return FSDPBackend(
            state,
            plugin=fsdp_plugin,
            precision=FSDPPrecision(mixed_precision, state.device, **precision_kwargs),
            dynamo_plugin=dynamo_plugin,
        )
    precision = Precision(mixed_precision, state.device, **precision_kwargs)
    if state.num_processes > 1:
        return DDPBackend(state, precision=precision, ddp_kwargs=ddp_kwargs, dynamo_plugin=dynamo_plugin)
    return SingleProcessBackend(state, precision=precision, dynamo_plugin=dynamo_plugin)
