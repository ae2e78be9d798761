"""The DeepSpeed backend's vocabulary: ``DeepSpeedPlugin``, the ``deepspeed_config`` section and the
``--use-deepspeed`` / ``--zero-stage`` ... launch flags (from :data:`lockstep.backends.deepspeed.keys.DEEPSPEED_KEYS`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lockstep.backends.deepspeed.keys import DEEPSPEED_KEYS
from lockstep.config.backend_specs import BackendRequest, BackendSpec, TypeFacts, register_backend_spec
from lockstep.config.enums import DistributedType


def _build(request: BackendRequest) -> Any:
    from lockstep.backends.deepspeed.backend import DeepSpeedBackend

    return DeepSpeedBackend(
        request.state,
        plugins=dict(request.deepspeed_plugins or {}),
        mixed_precision=request.mixed_precision,
        dynamo_plugin=request.dynamo_plugin,
    )


def _check_section(section: dict[str, Any], launch: Mapping[str, Any]) -> None:
    """Build the plugin the workers will build (without DeepSpeed) and check it against the launch."""
    from lockstep.backends.deepspeed.section import check_deepspeed_section

    if launch.get("use_parallelism_config"):
        raise ValueError(
            "--use-parallelism-config with DeepSpeed is not built: lockstep's N-D layouts run on FSDP2 and tensor "
            "parallelism. Drop --use-deepspeed (shard with --parallelism-config-dp-shard-size)."
        )
    try:
        check_deepspeed_section(
            section,
            mixed_precision=launch.get("mixed_precision", "no"),
            accumulation=launch.get("gradient_accumulation_steps", 1),
        )
    except (TypeError, ValueError) as error:
        raise ValueError(f"DeepSpeed settings: {error}") from None


def _plugin_from_section(section: dict[str, Any]) -> Any:
    from lockstep.backends.deepspeed.plugin import DeepSpeedPlugin
    from lockstep.backends.deepspeed.section import plugin_fields

    return DeepSpeedPlugin(**plugin_fields(section))


def _wizard(ask: Any) -> dict[str, Any]:
    from lockstep.backends.deepspeed.wizard import ask_deepspeed_section

    return ask_deepspeed_section(ask)


def _notes(section: dict[str, Any]) -> list[str]:
    from lockstep.backends.deepspeed.section import deepspeed_launcher_notes

    return deepspeed_launcher_notes(section)


SPEC = register_backend_spec(
    BackendSpec(
        name="deepspeed",
        summary="ZeRO stages 0-3 on DeepSpeed's engine (pip install 'lockstep[deepspeed]')",
        title="DeepSpeed",
        priority=10,
        applies=lambda request: bool(request.deepspeed_plugins),
        build=_build,
        plugin_type="lockstep.backends.deepspeed.plugin:DeepSpeedPlugin",
        accelerator_argument="deepspeed_plugin",
        trainer_argument="deepspeed",
        trainer_normalize="lockstep.backends.deepspeed.trainer_options:normalize_arguments",
        trainer_plugin="lockstep.backends.deepspeed.trainer_options:plugin_for_arguments",
        distributed_types=(DistributedType.DEEPSPEED,),
        type_facts={DistributedType.DEEPSPEED: TypeFacts(deepspeed=True)},
        config_section="deepspeed_config",
        keys=DEEPSPEED_KEYS,
        enable_flag="use_deepspeed",
        check_section=_check_section,
        plugin_from_section=_plugin_from_section,
        launcher_notes=_notes,
        wizard=_wizard,
        requirement="deepspeed",
    )
)
