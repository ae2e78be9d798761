"""The pipeline backend's vocabulary: a ``ParallelismConfig`` with ``pp_size > 1``."""

from __future__ import annotations

from typing import Any

from lockstep.backends.fsdp.spec import build_on_layout
from lockstep.config.backend_specs import BackendRequest, BackendSpec, register_backend_spec


def _build(request: BackendRequest) -> Any:
    from lockstep.backends.pp.backend import PipelineBackend

    return build_on_layout(request, PipelineBackend)


SPEC = register_backend_spec(
    BackendSpec(
        name="pipeline",
        summary="pipeline parallelism on torch.distributed.pipelining (stages FSDP2-sharded over dp_shard)",
        priority=20,
        applies=lambda request: request.layout_mesh_built and request.parallelism_config.pp_enabled,
        build=_build,
    )
)
