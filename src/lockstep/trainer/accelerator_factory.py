"""Creating the Trainer's Accelerator from ``TrainingArguments``, then checking the result.

:func:`create_accelerator_and_postprocess` is the one place where TrainingArguments become
Accelerator settings (the counterpart of transformers' method of the same name):

* gradient accumulation: the Trainer's ``gradient_accumulation_steps`` are given to the Accelerator
  explicitly, so a launcher's ``--gradient-accumulation-steps`` is not applied on top of them;
* ``accelerator_config`` -> ``DataLoaderConfiguration`` (with ``non_blocking`` and the data seed), and its
  ``gradient_accumulation_kwargs`` -> the ``GradientAccumulationPlugin`` (:func:`accumulation_plugin`);
* ``ddp_*`` -> ``DistributedDataParallelKwargs``; ``ddp_backend``/``ddp_timeout`` ->
  ``InitProcessGroupKwargs``; ``torch_compile*`` -> ``TorchDynamoPlugin``; each registered backend's field
  (``fsdp``/``fsdp_config``, ``deepspeed``) -> its plugin, built by its spec's ``trainer_plugin``
  (:func:`backend_plugins`); ``report_to`` -> trackers;
  ``output_dir`` -> project folder; ``parallelism_config`` -> the device mesh (a model transformers sharded
  at load time, ``tp_plan="auto"``, sets its tensor-parallel size by itself, as in transformers).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from torch import nn

from lockstep.accelerator import Accelerator
from lockstep.accelerator.settings import launcher_settings
from lockstep.config import (
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    InitProcessGroupKwargs,
    ProjectConfiguration,
    TorchDynamoPlugin,
)
from lockstep.config.backend_specs import (
    add_on_arguments,
    backend_specs,
    sectioned_specs,
    spec_for_distributed_type,
)
from lockstep.config.parallelism import ParallelismConfig
from lockstep.config.vocabulary import resolve_target
from lockstep.trainer._arguments_api import check_configured_state
from lockstep.trainer.accelerator_config import AcceleratorConfig
from lockstep.trainer.arguments import TrainingArguments

logger = logging.getLogger("lockstep.trainer")


def supports_gradient_checkpointing(model: nn.Module) -> bool:
    """transformers models say so with ``supports_gradient_checkpointing``."""
    enable = ("activation_checkpointing_enable", "gradient_checkpointing_enable")
    return bool(getattr(model, "supports_gradient_checkpointing", False)) and any(
        hasattr(model, name) for name in enable
    )


def is_transformers_model(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (without importing transformers)."""
    return any(
        cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers.")
        for cls in type(model).__mro__
    )


def _checkpointing_on(model: nn.Module) -> bool:
    """Whether activation checkpointing is on in a transformers model (5.x's name, then 4.x's)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if name in dir(type(model)):
            return bool(getattr(model, name))
    return False


def ddp_kwargs(args: TrainingArguments, model: nn.Module | None) -> DistributedDataParallelKwargs:
    """DDP settings from the ``ddp_*`` fields.

    ``find_unused_parameters`` defaults, as in transformers, to ``not gradient_checkpointing`` for transformers
    models (recomputed layers and DDP's unused-parameter search do not mix; models such as XLNet leave
    parameters unused in some steps); for other modules to False, where transformers says True: the search
    costs an extra pass over the autograd graph every step, so a module that leaves parameters unused needs
    ``ddp_find_unused_parameters=True`` (DDP's error says so).
    """
    if args.ddp_find_unused_parameters is not None:
        find_unused = args.ddp_find_unused_parameters
    elif model is not None and (is_transformers_model(model) or supports_gradient_checkpointing(model)):
        find_unused = not (args.gradient_checkpointing or _checkpointing_on(model))
    else:
        find_unused = False
    kwargs: dict[str, Any] = {"find_unused_parameters": find_unused}
    if args.ddp_bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = args.ddp_bucket_cap_mb
    if args.ddp_broadcast_buffers is not None:
        kwargs["broadcast_buffers"] = args.ddp_broadcast_buffers
    if args.ddp_static_graph is not None:
        kwargs["static_graph"] = args.ddp_static_graph
    return DistributedDataParallelKwargs(**kwargs)


def dataloader_configuration(args: TrainingArguments) -> DataLoaderConfiguration:
    config = args.accelerator_config
    assert isinstance(config, AcceleratorConfig)  # TrainingArguments converted it
    return DataLoaderConfiguration(
        split_batches=config.split_batches,
        dispatch_batches=config.dispatch_batches,
        even_batches=config.even_batches,
        use_seedable_sampler=config.use_seedable_sampler,
        non_blocking=config.non_blocking,
        data_seed=args.data_seed if args.data_seed is not None else args.seed,
    )


def dynamo_plugin(args: TrainingArguments) -> TorchDynamoPlugin | None:
    if not args.torch_compile:
        return None
    return TorchDynamoPlugin(backend=args.torch_compile_backend or "inductor", mode=args.torch_compile_mode)


def backend_plugins(
    args: TrainingArguments, model: nn.Module | None, launch: Mapping[str, Any]
) -> dict[str, Any]:
    """The ``Accelerator`` keyword of each registered backend that maps a ``TrainingArguments`` field to its
    plugin (``fsdp_plugin``, ``deepspeed_plugin``), with the plugin its spec's ``trainer_plugin`` builds (None
    when the field is unset). The backend the launcher chose also gets the section it passed, to check the
    arguments against it (a launcher config that selected FSDP makes ``fsdp``/``fsdp_config`` unnecessary;
    giving them anyway is allowed only when every setting they name agrees).
    """
    launched = spec_for_distributed_type(launch.get("distributed_type") or None)
    plugins: dict[str, Any] = {}
    for spec in backend_specs():
        if spec.trainer_plugin is None or spec.accelerator_argument is None:
            continue
        section = dict(launch.get(spec.config_section or "") or {}) if spec is launched else None
        plugins[spec.accelerator_argument] = resolve_target(spec.trainer_plugin)(args, model, section)
    return plugins


def check_launcher_agreement(args: TrainingArguments, launch: Mapping[str, Any]) -> None:
    """Fail when the launcher's config selected a backend and the arguments ask for another one."""
    launched = spec_for_distributed_type(launch.get("distributed_type") or None)
    if launched is None or launched.trainer_argument is None:
        return
    for spec in sectioned_specs():
        if spec is not launched and spec.trainer_argument and getattr(args, spec.trainer_argument, None):
            raise ValueError(
                f"The launcher's config selected {launched.title}, but TrainingArguments({spec.trainer_argument}=...) "
                f"asks for {spec.title}. Remove {spec.trainer_argument} from the arguments or change the launcher's "
                "config."
            )


def check_accumulation(args: TrainingArguments, launch: Mapping[str, Any]) -> None:
    launched = launch.get("gradient_accumulation_steps")
    if launched not in (None, 1) and launched != args.gradient_accumulation_steps:
        logger.warning(
            "The launcher asked for gradient_accumulation_steps=%s, TrainingArguments for %s: the Trainer uses %s "
            "(it accumulates itself, once). Pass --gradient_accumulation_steps to the script instead.",
            launched,
            args.gradient_accumulation_steps,
            args.gradient_accumulation_steps,
        )


def accumulation_plugin(args: TrainingArguments) -> GradientAccumulationPlugin:
    """``gradient_accumulation_steps`` with ``accelerator_config.gradient_accumulation_kwargs``, by transformers'
    rule: a ``num_steps`` there replaces the steps (which must then be 1) in the arguments too;
    ``sync_each_batch`` is passed on; ``adjust_scheduler`` and ``sync_with_dataloader`` have no effect (the
    Trainer accumulates and steps its scheduler itself), which a warning says.

    Raises:
        ValueError: ``num_steps`` is given and ``gradient_accumulation_steps`` is more than 1.
    """
    config = args.accelerator_config
    assert isinstance(config, AcceleratorConfig)  # TrainingArguments converted it
    kwargs = dict(config.gradient_accumulation_kwargs or {})
    if "num_steps" in kwargs and kwargs["num_steps"] != args.gradient_accumulation_steps:
        if args.gradient_accumulation_steps > 1:
            raise ValueError(
                f"TrainingArguments(gradient_accumulation_steps={args.gradient_accumulation_steps}) and "
                f"accelerator_config gradient_accumulation_kwargs num_steps={kwargs['num_steps']} both set the "
                "accumulation steps, so which one is meant is unclear. Set one of them: leave "
                "gradient_accumulation_steps at 1 to use num_steps, or drop num_steps."
            )
        args.gradient_accumulation_steps = kwargs["num_steps"]
    ignored = [key for key in ("adjust_scheduler", "sync_with_dataloader") if key in kwargs]
    if ignored:
        logger.warning(
            "accelerator_config gradient_accumulation_kwargs %s: no effect in the Trainer, which accumulates "
            "and steps its scheduler itself (as in transformers).",
            ", ".join(f"{key}={kwargs[key]}" for key in ignored),
        )
    return GradientAccumulationPlugin(
        num_steps=args.gradient_accumulation_steps, sync_each_batch=kwargs.get("sync_each_batch", False)
    )


def create_accelerator_and_postprocess(
    args: TrainingArguments, model: nn.Module | None = None
) -> Accelerator:
    """Create the Accelerator the Trainer drives, then validate the combination.

    Raises:
        ValueError: a backend's settings that contradict the arguments (DeepSpeed config values, FSDP's
            activation checkpointing with ``gradient_checkpointing``) or the launcher's config.
    """
    check_configured_state(args)
    launch = launcher_settings()  # the Accelerator's reading of what lockstep launch asked for
    check_launcher_agreement(args, launch)
    accumulation = accumulation_plugin(args)  # may set gradient_accumulation_steps: before anything reads it
    check_accumulation(args, launch)
    plugins = backend_plugins(args, model, launch)
    accelerator = Accelerator(
        mixed_precision=args.mixed_precision,
        cpu=args.use_cpu,
        gradient_accumulation_plugin=accumulation,
        dataloader_config=dataloader_configuration(args),
        project_config=ProjectConfiguration(
            project_dir=args.output_dir,
            logging_dir=args.logging_dir,
            save_on_each_node=args.save_on_each_node,
        ),
        kwargs_handlers=[
            ddp_kwargs(args, model),
            InitProcessGroupKwargs(backend=args.ddp_backend, timeout=timedelta(seconds=args.ddp_timeout)),
        ],
        dynamo_plugin=dynamo_plugin(args),
        **plugins,
        **add_on_arguments(lambda field: getattr(args, field, None)),
        elastic_keep_global_batch=args.elastic_keep_global_batch,
        parallelism_config=parallelism_config_for(args, model),
        log_with=list(args.report_to) or None,  # type: ignore[arg-type]
        step_scheduler_with_optimizer=False,  # the Trainer steps its scheduler once per optimizer step
    )
    _postprocess(args, accelerator)
    return accelerator


def parallelism_config_for(args: TrainingArguments, model: nn.Module | None) -> ParallelismConfig | None:
    """``args.parallelism_config``; for a model transformers split at load time (``from_pretrained(...,
    tp_plan="auto")``: ``model.tp_size > 1``) one with the model's tensor-parallel size (and the data-parallel
    size of its ``distributed_config``), as transformers' Trainer does."""
    config = args.parallelism_config
    model_tp = (getattr(model, "tp_size", None) or 1) if model is not None else 1
    if model_tp <= 1:
        return config
    distributed = getattr(getattr(model, "config", None), "distributed_config", None)
    model_dp = getattr(distributed, "dp_size", None) or 1
    if config is None:
        return ParallelismConfig(tp_size=model_tp, dp_shard_size=model_dp)
    if config.tp_size != model_tp:
        logger.warning(
            "TrainingArguments(parallelism_config=...) has tp_size=%s, but the model was split over %s processes "
            "when it was loaded (tp_plan): the Trainer uses tp_size=%s.",
            config.tp_size,
            model_tp,
            model_tp,
        )
        config.tp_size = model_tp
    return config


def _postprocess(args: TrainingArguments, accelerator: Accelerator) -> None:
    if accelerator.non_blocking and not args.dataloader_pin_memory:
        logger.warning(
            "accelerator_config non_blocking=True has no effect without dataloader_pin_memory=True: copies from "
            "pageable memory are synchronous. Set dataloader_pin_memory=True (the default)."
        )
