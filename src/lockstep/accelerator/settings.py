"""Turning ``Accelerator(...)`` arguments into validated settings, in one place.

Precedence: an explicit constructor argument > the launcher's serialized settings
(``LOCKSTEP_LAUNCH_CONFIG``) > the default.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from lockstep import _env
from lockstep.backends.deepspeed.settings import (
    accumulation_from_config,
    precision_from_config,
    resolve_deepspeed,
)
from lockstep.backends.fsdp.plugin import FullyShardedDataParallelPlugin
from lockstep.config.backend_specs import backend_specs, launched_plugin
from lockstep.config.dataloader import DataLoaderConfiguration
from lockstep.config.enums import PrecisionType, RNGType
from lockstep.config.kwargs import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProfileKwargs,
)
from lockstep.config.parallelism import ParallelismConfig
from lockstep.config.parallelism_keys import LAYOUT
from lockstep.config.plugins import GradientAccumulationPlugin, TorchDynamoPlugin
from lockstep.config.project import ProjectConfiguration
from lockstep.diagnostics.settings import HangDetectionKwargs
from lockstep.precision import parse_mixed_precision
from lockstep.throughput.config import ThroughputKwargs

_NOT_YET_BUILT = {
    "torch_tp_plugin": "Accelerate's deprecated tensor-parallel plugin (tensor parallelism is "
    "parallelism_config=ParallelismConfig(tp_size=...))",
    "megatron_lm_plugin": "the Megatron-LM backend",
}


@dataclass
class KwargsHandlers:
    """The user's ``kwargs_handlers``, sorted by kind (at most one of each)."""

    ddp: DistributedDataParallelKwargs | None = None
    scaler: GradScalerKwargs | None = None
    init: InitProcessGroupKwargs | None = None
    autocast: AutocastKwargs | None = None
    profile: ProfileKwargs | None = None
    throughput: ThroughputKwargs | None = None
    hang: HangDetectionKwargs | None = None
    backend_plugins: tuple[Any, ...] = ()
    """Objects of a registered backend's plugin type (a user backend): they select that backend."""


_HANDLER_SLOTS = {
    DistributedDataParallelKwargs: "ddp",
    GradScalerKwargs: "scaler",
    InitProcessGroupKwargs: "init",
    AutocastKwargs: "autocast",
    ProfileKwargs: "profile",
    ThroughputKwargs: "throughput",
    HangDetectionKwargs: "hang",
}


def sort_kwargs_handlers(handlers: Iterable[Any] | None) -> KwargsHandlers:
    """Check each handler's kind and that none is given twice."""
    result = KwargsHandlers()
    for index, handler in enumerate(handlers or []):
        if type(handler) not in _HANDLER_SLOTS and _backend_plugin(handler, index):
            if any(type(given) is type(handler) for given in result.backend_plugins):
                raise ValueError(
                    f"kwargs_handlers holds more than one {type(handler).__name__}; pass it once."
                )
            result.backend_plugins += (handler,)
            continue
        if not isinstance(handler, KwargsHandler):
            raise TypeError(
                f"kwargs_handlers[{index}] is a {type(handler).__name__}; each handler must be one of "
                f"{', '.join(c.__name__ for c in _HANDLER_SLOTS)}."
            )
        slot = _HANDLER_SLOTS.get(type(handler))
        if slot is None:
            raise TypeError(
                f"kwargs_handlers[{index}]: {type(handler).__name__} is not supported by the Accelerator."
            )
        if getattr(result, slot) is not None:
            raise ValueError(f"kwargs_handlers holds more than one {type(handler).__name__}; pass it once.")
        setattr(result, slot, handler)
    return result


def _backend_plugin(handler: Any, index: int) -> bool:
    """Whether ``handler`` is the plugin of a backend registered from user code (``register_backend``).

    Raises:
        TypeError: the plugin of a backend that takes it as its own ``Accelerator`` argument.
    """
    from lockstep.config.backend_specs import plugin_types

    spec = next((s for kind, s in plugin_types().items() if isinstance(handler, kind)), None)
    if spec is not None and spec.accelerator_argument is not None:
        raise TypeError(
            f"kwargs_handlers[{index}] is a {type(handler).__name__}, which configures {spec.name}: "
            f"pass it as Accelerator({spec.accelerator_argument}=...)."
        )
    return spec is not None


_DEPRECATED_DATALOADER_ARGUMENTS = (
    "split_batches",
    "dispatch_batches",
    "even_batches",
    "use_seedable_sampler",
)


def apply_deprecated_dataloader_arguments(
    dataloader_config: DataLoaderConfiguration | None, given: dict[str, Any]
) -> DataLoaderConfiguration | None:
    """``Accelerator(split_batches=..., dispatch_batches=..., even_batches=..., use_seedable_sampler=...)``,
    Accelerate's older spelling: applied to the dataloader configuration with a FutureWarning that shows
    the ``DataLoaderConfiguration`` to write instead. (Accelerate 1.x keeps ``split_batches`` in its
    signature but ignores the value; lockstep applies it.)"""
    given = {name: value for name, value in given.items() if value is not _NOT_GIVEN}
    if not given:
        return dataloader_config
    config = dataloader_config if dataloader_config is not None else DataLoaderConfiguration()
    for name, value in given.items():
        setattr(config, name, value)
    config.__post_init__()  # the values are checked like the configuration's own
    spelled = ", ".join(f"{name}={value!r}" for name, value in given.items())
    warnings.warn(
        f"Passing {', '.join(given)} to Accelerator() is deprecated (as in Accelerate): pass "
        f"Accelerator(dataloader_config=DataLoaderConfiguration({spelled})) instead. The values are applied.",
        FutureWarning,
        stacklevel=3,
    )
    return config


class _NotGiven:
    """The default of a deprecated argument, so that an explicit False or None is told apart from none."""

    def __repr__(self) -> str:
        return "<not given>"


_NOT_GIVEN: Any = _NotGiven()
NOT_GIVEN: Any = _NOT_GIVEN


def reject_unbuilt_features(**arguments: Any) -> None:
    """Raise for arguments whose feature does not exist yet, rather than ignoring them silently."""
    for name, value in arguments.items():
        if value is not None and value is not False:
            raise NotImplementedError(
                f"Accelerator({name}=...) is not supported yet: {_NOT_YET_BUILT[name]} is not part of this "
                f"version of lockstep. Remove {name} to train with DDP (or a single process)."
            )


@dataclass
class AcceleratorSettings:
    """Every resolved constructor setting of the Accelerator."""

    mixed_precision: PrecisionType
    gradient_accumulation_plugin: GradientAccumulationPlugin
    dataloader_config: DataLoaderConfiguration
    project_config: ProjectConfiguration
    dynamo_plugin: TorchDynamoPlugin | None
    rng_types: list[RNGType]
    handlers: KwargsHandlers = field(default_factory=KwargsHandlers)
    fsdp_plugin: FullyShardedDataParallelPlugin | None = None
    deepspeed_plugins: dict[str, Any] | None = None
    """The named ``DeepSpeedPlugin`` objects (the selected one configures the next engine), or None."""
    parallelism_config: ParallelismConfig | None = None
    """The N-D layout (``ParallelismConfig``), or None."""
    launcher: dict[str, Any] = field(default_factory=dict)
    """What the launcher asked for (``lockstep launch`` flags and config file, as the workers received
    them); empty when the script was not started by ``lockstep launch``. Explicit arguments override it."""


def launcher_settings() -> dict[str, Any]:
    """What ``lockstep launch`` asked the workers for (mixed precision, accumulation, the FSDP section...),
    or an empty dict when the script was started some other way. The Accelerator resolves its settings
    against it; the Trainer checks its arguments against it before building the Accelerator."""
    return dict(_env.launch_settings())


def _plugin_type(argument: str) -> type:
    """The plugin type of the registered backend that takes the ``Accelerator`` keyword ``argument``."""
    return next(
        spec.resolved_plugin_type() for spec in backend_specs() if spec.accelerator_argument == argument
    )


def resolve_fsdp(
    plugin: FullyShardedDataParallelPlugin | None, deepspeed_plugin: Any, launch: dict[str, Any]
) -> FullyShardedDataParallelPlugin | None:
    """The FSDP plugin: the explicit one, else the launcher's ``distributed_type: FSDP`` settings."""
    if plugin is not None and deepspeed_plugin is not None:
        raise ValueError(
            "Accelerator(fsdp_plugin=..., deepspeed_plugin=...): FSDP and DeepSpeed both shard the model and "
            "cannot be combined. Pass one of them."
        )
    if plugin is not None:
        if not isinstance(plugin, _plugin_type("fsdp_plugin")):
            raise TypeError(
                f"fsdp_plugin must be a lockstep FullyShardedDataParallelPlugin, got {type(plugin).__name__}."
            )
        return plugin
    return launched_plugin(launch, "fsdp_plugin")


def resolve_parallelism(
    config: ParallelismConfig | None, deepspeed: Any, launch: dict[str, Any]
) -> ParallelismConfig | None:
    """The ``ParallelismConfig``: the explicit one, else the launcher's ``parallelism_config`` section (sent
    when ``lockstep launch`` got ``--use-parallelism-config``, a ``--parallelism-config-*`` flag or the
    config file's section), else one from the ``PARALLELISM_CONFIG_*`` variables when
    ``ACCELERATE_USE_PARALLELISM_CONFIG=true``."""
    if config is None:
        section = launch.get(LAYOUT.config_section or "")
        if section is not None and LAYOUT.plugin_from_section is not None:
            config = LAYOUT.plugin_from_section(section)
        elif _env.parallelism_config_requested():
            config = ParallelismConfig()
    if config is None:
        return None
    if not isinstance(config, ParallelismConfig):
        raise TypeError(
            f"parallelism_config must be a lockstep ParallelismConfig, got {type(config).__name__}."
        )
    if deepspeed is not None:
        raise NotImplementedError(
            "Accelerator(parallelism_config=..., deepspeed_plugin=...) is not built yet: lockstep's N-D layouts "
            "run on FSDP2 and tensor parallelism. Drop the DeepSpeed plugin (shard with dp_shard_size)."
        )
    if config.sp_size > 1:
        raise NotImplementedError(
            f"ParallelismConfig(sp_size={config.sp_size}) is not built yet: DeepSpeed-Ulysses sequence parallelism "
            "is not part of lockstep. Leave sp_size=1."
        )
    return config


def resolve_mixed_precision(explicit: str | None, launch: dict[str, Any]) -> PrecisionType:
    value = explicit if explicit is not None else launch.get("mixed_precision", "no")
    return parse_mixed_precision(value)


def resolve_accumulation(
    steps: int | None, plugin: GradientAccumulationPlugin | None, launch: dict[str, Any]
) -> GradientAccumulationPlugin:
    if plugin is not None:
        if steps not in (None, 1):
            raise ValueError(
                f"Accelerator(gradient_accumulation_steps={steps}) conflicts with gradient_accumulation_plugin: "
                "set num_steps in the plugin and leave gradient_accumulation_steps out."
            )
        if not isinstance(plugin, GradientAccumulationPlugin):
            raise TypeError(
                f"gradient_accumulation_plugin must be a GradientAccumulationPlugin, got {plugin!r}."
            )
        if plugin.num_steps is None:
            plugin.num_steps = 1
        return plugin
    if steps is None:
        steps = launch.get("gradient_accumulation_steps", 1)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(
            f"Accelerator(gradient_accumulation_steps={steps!r}) is invalid: it must be an integer >= 1. "
            "Pass 1 to disable accumulation."
        )
    return GradientAccumulationPlugin(num_steps=steps)


def resolve_dynamo(
    backend: str | None, plugin: TorchDynamoPlugin | None, launch: dict[str, Any]
) -> TorchDynamoPlugin | None:
    if backend is not None and plugin is not None:
        raise ValueError("Pass either dynamo_backend or dynamo_plugin to the Accelerator, not both.")
    if plugin is not None:
        return plugin if plugin.enabled else None
    from_launcher = backend is None
    if from_launcher:
        backend = launch.get("dynamo_backend")
    if (
        backend is None
    ):  # accelerate launch's ACCELERATE_DYNAMO_* variables, read by the plugin as in Accelerate
        plugin = TorchDynamoPlugin()
        return plugin if plugin.enabled else None
    # The launcher's --dynamo_mode/--dynamo_use_* settings go with the launcher's backend only.
    settings = dict(launch.get("dynamo_plugin") or {}) if from_launcher else {}
    resolved = TorchDynamoPlugin(backend=backend, **settings)
    return resolved if resolved.enabled else None


def resolve_rng_types(
    rng_types: Iterable[str] | None, dataloader_config: DataLoaderConfiguration
) -> list[RNGType]:
    if rng_types is None:
        return [] if dataloader_config.use_seedable_sampler else [RNGType.GENERATOR]
    return [RNGType.parse(r, argument="rng_types") for r in rng_types]


def resolve_project(
    project_dir: str | None, project_config: ProjectConfiguration | None
) -> ProjectConfiguration:
    config = project_config if project_config is not None else ProjectConfiguration()
    if project_dir is not None:
        config.set_directories(str(project_dir))
    return config


def resolve_settings(
    *,
    mixed_precision: str | None,
    gradient_accumulation_steps: int | None,
    gradient_accumulation_plugin: GradientAccumulationPlugin | None,
    dataloader_config: DataLoaderConfiguration | None,
    project_dir: str | None,
    project_config: ProjectConfiguration | None,
    dynamo_backend: str | None,
    dynamo_plugin: TorchDynamoPlugin | None,
    rng_types: Iterable[str] | None,
    kwargs_handlers: Iterable[Any] | None,
    fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
    deepspeed_plugin: Any = None,
    deepspeed_plugins: Any = None,
    parallelism_config: ParallelismConfig | None = None,
) -> AcceleratorSettings:
    """Validate and resolve the Accelerator's arguments against the launcher's settings."""
    launch = launcher_settings()
    fsdp = resolve_fsdp(fsdp_plugin, deepspeed_plugin or deepspeed_plugins, launch)
    deepspeed = None if fsdp is not None else resolve_deepspeed(deepspeed_plugin, deepspeed_plugins, launch)
    if deepspeed is not None:
        active = next(p for p in deepspeed.values() if p.selected)
        if gradient_accumulation_plugin is None:
            gradient_accumulation_steps = accumulation_from_config(
                active,
                gradient_accumulation_steps or launch.get("gradient_accumulation_steps", 1),
                given=gradient_accumulation_steps is not None or "gradient_accumulation_steps" in launch,
            )
        given = mixed_precision is not None or launch.get("mixed_precision", "no") != "no"
        mixed_precision = precision_from_config(
            active, mixed_precision or launch.get("mixed_precision", "no"), given=given
        )
    dataloader_config = dataloader_config if dataloader_config is not None else DataLoaderConfiguration()
    if not isinstance(dataloader_config, DataLoaderConfiguration):
        raise TypeError(
            f"dataloader_config must be a DataLoaderConfiguration, got {type(dataloader_config).__name__}."
        )
    return AcceleratorSettings(
        mixed_precision=resolve_mixed_precision(mixed_precision, launch),
        gradient_accumulation_plugin=resolve_accumulation(
            gradient_accumulation_steps, gradient_accumulation_plugin, launch
        ),
        dataloader_config=dataloader_config,
        project_config=resolve_project(project_dir, project_config),
        dynamo_plugin=resolve_dynamo(dynamo_backend, dynamo_plugin, launch),
        rng_types=resolve_rng_types(rng_types, dataloader_config),
        handlers=sort_kwargs_handlers(kwargs_handlers),
        fsdp_plugin=fsdp,
        deepspeed_plugins=deepspeed,
        parallelism_config=resolve_parallelism(parallelism_config, deepspeed, launch),
        launcher=dict(launch),
    )
