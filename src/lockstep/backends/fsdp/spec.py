"""The FSDP2 backend's vocabulary: ``FullyShardedDataParallelPlugin``, the ``fsdp_config`` section and the
``--use-fsdp`` / ``--fsdp-*`` launch flags (from :data:`lockstep.backends.fsdp.keys.FSDP_KEYS`)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from lockstep.backends.fsdp.keys import FSDP_KEYS
from lockstep.config.backend_specs import BackendRequest, BackendSpec, TypeFacts, register_backend_spec
from lockstep.config.enums import DistributedType


def sharding_precision(request: BackendRequest) -> Any:
    """The precision of a backend that shards with FSDP2 (its ``MixedPrecisionPolicy`` comes from it)."""
    from lockstep.backends.fsdp.precision import FSDPPrecision
    from lockstep.precision import precision_for

    return precision_for(request, FSDPPrecision)


def plugin_or_default(request: BackendRequest) -> Any:
    """The user's FSDP plugin, or the default one (a layout that shards without a plugin given)."""
    if request.fsdp_plugin is not None:
        return request.fsdp_plugin
    from lockstep.backends.fsdp.plugin import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin()


def build_on_layout(request: BackendRequest, backend_class: type) -> Any:
    """A backend that lays the model out on the ``ParallelismConfig``'s mesh (N-D, pipeline), sharding with
    the user's FSDP plugin or the default one."""
    return backend_class(
        request.state,
        config=request.parallelism_config,
        plugin=plugin_or_default(request),
        precision=sharding_precision(request),
        dynamo_plugin=request.dynamo_plugin,
    )


def _applies(request: BackendRequest) -> bool:
    if request.fsdp_plugin is None:
        return False
    if request.layout_mesh_built:  # sharding layouts are taken by the N-D and pipeline backends before
        raise ValueError(
            f"ParallelismConfig(dp_replicate_size={request.parallelism_config.dp_replicate_size}) alone means "
            "plain data parallelism, but an FSDP plugin was given: set dp_shard_size instead to shard the model."
        )
    return True


def _build(request: BackendRequest) -> Any:
    from lockstep.backends.fsdp.backend import FSDPBackend

    return FSDPBackend(
        request.state,
        plugin=request.fsdp_plugin,
        precision=sharding_precision(request),
        dynamo_plugin=request.dynamo_plugin,
    )


def _plugin_from_section(section: dict[str, Any]) -> Any:
    from lockstep.backends.fsdp.plugin import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin.from_config_section(section)


def _check_section(section: dict[str, Any], launch: Mapping[str, Any]) -> None:
    """Build the plugin once, so that a bad FSDP setting fails before any process starts."""
    from lockstep.backends.fsdp.plugin import FullyShardedDataParallelPlugin

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the workers warn once each, where the user reads it
            FullyShardedDataParallelPlugin.from_config_section(section)
    except (TypeError, ValueError) as error:
        raise ValueError(f"FSDP settings: {error}") from None


SPEC = register_backend_spec(
    BackendSpec(
        name="fsdp",
        summary="fully sharded data parallel on torch's FSDP2 (fully_shard) over every process",
        title="FSDP",
        priority=40,
        applies=_applies,
        build=_build,
        plugin_type="lockstep.backends.fsdp.plugin:FullyShardedDataParallelPlugin",
        accelerator_argument="fsdp_plugin",
        trainer_argument="fsdp",
        trainer_normalize="lockstep.backends.fsdp.trainer_options:normalize_arguments",
        trainer_plugin="lockstep.backends.fsdp.trainer_options:plugin_for_arguments",
        distributed_types=(DistributedType.FSDP,),
        type_facts={DistributedType.FSDP: TypeFacts(fsdp2=True)},  # lockstep's FSDP is always FSDP2
        config_section="fsdp_config",
        keys=FSDP_KEYS,
        enable_flag="use_fsdp",
        check_section=_check_section,
        plugin_from_section=_plugin_from_section,
        wizard=lambda ask: {"fsdp_version": 2},
    )
)
