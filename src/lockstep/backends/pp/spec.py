"""The pipeline backend's vocabulary: a ``ParallelismConfig`` with ``pp_size > 1``."""

from __future__ import annotations

from typing import Any

from lockstep.backends.fsdp.spec import plugin_or_default, sharding_precision
from lockstep.config.backend_specs import BackendRequest, BackendSpec, register_backend_spec


def _build(request: BackendRequest) -> Any:
    from lockstep.backends.pp.backend import PipelineBackend

    return PipelineBackend(
        request.state,
        config=request.parallelism_config,
        plugin=plugin_or_default(request),
        precision=sharding_precision(request),
        dynamo_plugin=request.dynamo_plugin,
    )


SPEC = register_backend_spec(
    BackendSpec(
        name="pipeline",
        summary="pipeline parallelism on torch.distributed.pipelining (stages FSDP2-sharded over dp_shard)",
        priority=20,
        applies=lambda request: request.layout_mesh_built and request.parallelism_config.pp_enabled,
        build=_build,
    )
)
