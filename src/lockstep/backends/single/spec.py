"""The one-process backend's vocabulary: what applies when nothing else does (no launch switch, no section)."""

from __future__ import annotations

from typing import Any

from lockstep.config.backend_specs import BackendRequest, BackendSpec, register_backend_spec
from lockstep.config.enums import DistributedType


def _build(request: BackendRequest) -> Any:
    from lockstep.backends.single.backend import SingleProcessBackend
    from lockstep.precision import precision_for

    return SingleProcessBackend(
        request.state, precision=precision_for(request), dynamo_plugin=request.dynamo_plugin
    )


SPEC = register_backend_spec(
    BackendSpec(
        name="single",
        summary="one process on one device: the model as it is",
        priority=100,
        applies=lambda request: True,
        build=_build,
        distributed_types=(DistributedType.NO,),
    )
)
