"""The N-D backend's vocabulary: a ``ParallelismConfig`` with tensor, context or sharded data-parallel
dimensions (the ``parallelism_config`` section is the layout's, shared with the pipeline backend)."""

from __future__ import annotations

from typing import Any

from lockstep.backends.fsdp.spec import build_on_layout
from lockstep.config.backend_specs import BackendRequest, BackendSpec, register_backend_spec


def _applies(request: BackendRequest) -> bool:
    config = request.parallelism_config
    return request.layout_mesh_built and bool(config.dp_shard_cp_dim_names or config.tp_enabled)


def _build(request: BackendRequest) -> Any:
    from lockstep.backends.nd.backend import NDParallelBackend

    return build_on_layout(request, NDParallelBackend)


SPEC = register_backend_spec(
    BackendSpec(
        name="nd",
        summary="tensor, context and sharded data parallelism composed on a device mesh (ParallelismConfig)",
        priority=30,
        applies=_applies,
        build=_build,
    )
)
