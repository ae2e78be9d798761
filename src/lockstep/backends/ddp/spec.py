"""The data-parallel backend's vocabulary: more than one process and no sharding asked for."""

from __future__ import annotations

from typing import Any

from lockstep.config.backend_specs import BackendRequest, BackendSpec, TypeFacts, register_backend_spec
from lockstep.config.enums import DistributedType


def _build(request: BackendRequest) -> Any:
    from lockstep.backends.ddp.backend import DDPBackend
    from lockstep.precision import precision_for

    return DDPBackend(
        request.state,
        precision=precision_for(request),
        ddp_kwargs=request.ddp_kwargs,
        dynamo_plugin=request.dynamo_plugin,
    )


SPEC = register_backend_spec(
    BackendSpec(
        name="ddp",
        summary="data parallel: torch's DistributedDataParallel, one replica per process",
        priority=90,
        applies=lambda request: request.state.num_processes > 1,
        build=_build,
        distributed_types=(
            DistributedType.MULTI_CPU,
            DistributedType.MULTI_GPU,
            DistributedType.MULTI_XPU,
            DistributedType.MULTI_MPS,
        ),
        type_facts={
            DistributedType.MULTI_GPU: TypeFacts(multi_device=True, gpu_only=True),
            DistributedType.MULTI_XPU: TypeFacts(multi_device=True),
            DistributedType.MULTI_MPS: TypeFacts(multi_device=True),
        },
    )
)
