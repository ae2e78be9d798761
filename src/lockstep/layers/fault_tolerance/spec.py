"""Fault tolerance's vocabulary: ``Accelerator(fault_tolerance=FaultToleranceConfig(...))``, the
``TrainingArguments(fault_tolerance=...)`` field, the ``fault_tolerance_config`` section and ``lockstep launch
--fault-tolerance`` (:mod:`lockstep.layers.fault_tolerance.launch`).

A layer, not a backend: the backend the settings choose trains each group inside (one process, DDP or FSDP2),
and the layer's step hooks (:mod:`lockstep.layers.fault_tolerance.layer`) add the quorum, the average across
groups and the heal. A run that combines fault tolerance with a layout it does not support yet (DeepSpeed, a
ParallelismConfig) is refused by name when the Accelerator is built.
"""

from __future__ import annotations

from lockstep.config.layer_specs import LayerSpec, register_layer
from lockstep.layers.fault_tolerance.launch import (
    FT_KEYS,
    SECTION,
    check_section,
    config_from_section,
    lighthouse_for,
)

NAME = "fault_tolerance"

SPEC = register_layer(
    LayerSpec(
        name=NAME,
        summary="live fault tolerance: replica groups averaged through torchft's per-step quorum (pip install 'lockstep[ft]')",
        title="torchft",
        step_hooks="lockstep.layers.fault_tolerance.layer:fault_tolerance_hooks",
        plugin_type="lockstep.layers.fault_tolerance.config:FaultToleranceConfig",
        accelerator_argument="fault_tolerance",
        trainer_argument="fault_tolerance",
        requirement="torchft",
        config_section=SECTION,
        keys=FT_KEYS,
        enable_flag="fault_tolerance",
        check_section=check_section,
        plugin_from_section=config_from_section,
        launch_service=lighthouse_for,
    )
)
