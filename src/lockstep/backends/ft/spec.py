"""The fault-tolerant backend's vocabulary: ``Accelerator(fault_tolerance=FaultToleranceConfig(...))``, the
``fault_tolerance_config`` section and ``lockstep launch --fault-tolerance`` (:mod:`lockstep.backends.ft.launch`).

Asked first (priority 5): it builds the backend that trains each group inside (one process, DDP or FSDP2:
whichever applies without fault tolerance) and layers itself over it; a request that combines fault
tolerance with a layout it does not support yet (DeepSpeed, a ParallelismConfig) is refused by name instead
of being trained by another backend.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lockstep.backends.ft.launch import (
    FT_KEYS,
    PIP_LINE,
    SECTION,
    check_section,
    config_from_section,
    lighthouse_for,
)
from lockstep.config.backend_specs import BackendRequest, BackendSpec, register_backend_spec

NAME = "fault_tolerant"


def _applies(request: BackendRequest) -> bool:
    from lockstep.backends.ft.config import FaultToleranceConfig

    config = request.plugin_of(FaultToleranceConfig)
    if config is None:
        return False
    unsupported = {
        "DeepSpeed (deepspeed_plugin)": bool(request.deepspeed_plugins),
        "a ParallelismConfig (pipeline, tensor, context or sharded layouts)": (
            request.parallelism_config is not None
        ),
    }
    for name, given in unsupported.items():
        if given:
            raise ValueError(
                f"Accelerator(fault_tolerance=...) with {name} is not supported yet: each replica group trains "
                "its replica on one process, or on several with DDP or FSDP. Drop one of the two settings."
            )
    return True


def _build(request: BackendRequest) -> Any:
    from lockstep.backends.ft.config import FaultToleranceConfig

    try:
        import torchft  # noqa: F401
    except ImportError as error:
        raise ImportError(
            f"Accelerator(fault_tolerance=...) trains on torchft, which is not installed: {PIP_LINE}."
        ) from error
    from lockstep.backends.ft.backend import FaultTolerantBackend
    from lockstep.backends.registry import build_backend

    config = request.plugin_of(FaultToleranceConfig)
    # The group's own training (one process, DDP or FSDP2), chosen as it would be without fault tolerance.
    inner = build_backend(
        dataclasses.replace(request, plugins=tuple(p for p in request.plugins if p is not config)),
        skip=(NAME,),
    )
    return FaultTolerantBackend(request.state, config=config, inner=inner)


SPEC = register_backend_spec(
    BackendSpec(
        name=NAME,
        summary="live fault tolerance: replica groups averaged through torchft's per-step quorum (pip install 'lockstep[ft]')",
        title="torchft",
        priority=5,
        applies=_applies,
        build=_build,
        plugin_type="lockstep.backends.ft.config:FaultToleranceConfig",
        accelerator_argument="fault_tolerance",
        trainer_argument="fault_tolerance",
        requirement="torchft",
        config_section=SECTION,
        keys=FT_KEYS,
        enable_flag="fault_tolerance",
        add_on=True,
        check_section=check_section,
        plugin_from_section=config_from_section,
        launch_service=lighthouse_for,
    )
)
