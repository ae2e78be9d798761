"""``TrainingArguments(deepspeed=...)``: the DeepSpeed plugin the Trainer's Accelerator trains with.

Named by the DeepSpeed spec: :func:`normalize_arguments` is its ``trainer_normalize``,
:func:`plugin_for_arguments` its ``trainer_plugin``; :func:`fill_schedule` fills the config scheduler's
``"auto"`` values for the backend's :class:`~lockstep.backends.capabilities.ConfiguredOptimizer`.

The config's ``"auto"`` values are filled from the arguments, as transformers fills them: batch sizes,
accumulation, ``max_grad_norm``, AdamW's learning rate, betas, epsilon and weight decay, the warm-up
scheduler's rates and steps, bf16/fp16. A value the config writes that contradicts an argument is an
error listing every such value. The bucket sizes that depend on the model are filled at ``prepare``.

A config ``optimizer`` is used through ``DummyOptim`` and a config ``scheduler`` through
``DummyScheduler``; without them the Trainer's own optimizer and scheduler are used (a scheduler for the
config's optimizer is built on the optimizer DeepSpeed makes).
"""

from __future__ import annotations

from typing import Any

from lockstep.backends.deepspeed.plugin import DeepSpeedPlugin
from lockstep.config.argument_values import load_json_dict

TrainingArguments = Any
"""The Trainer's arguments (``lockstep.trainer.TrainingArguments``; the backends never import the Trainer)."""


def normalize_arguments(args: TrainingArguments) -> None:
    """``deepspeed`` as a dict (given as one, as JSON text or as a JSON file's path), in place.

    Raises:
        ValueError: ``parallelism_config`` is given too: lockstep's device mesh does not run DeepSpeed.
    """
    args.deepspeed = load_json_dict(args.deepspeed, argument="deepspeed")
    if args.deepspeed and args.parallelism_config is not None:
        raise ValueError(
            "TrainingArguments sets both parallelism_config and deepspeed: lockstep's device mesh runs on FSDP2 and "
            "tensor parallelism, not DeepSpeed. Drop deepspeed (shard with dp_shard_size)."
        )


def plugin_for_arguments(args: TrainingArguments, model: Any, launched: dict[str, Any] | None) -> Any:
    """:func:`deepspeed_plugin_for` on the job's number of processes (the launcher's ``WORLD_SIZE``)."""
    if not args.deepspeed:
        return None
    from lockstep.state import PartialState

    return deepspeed_plugin_for(args, PartialState().num_processes)


def deepspeed_plugin_for(args: TrainingArguments, num_processes: int) -> DeepSpeedPlugin | None:
    """The plugin for ``args.deepspeed`` with the arguments' values filled in (None without it).

    Raises:
        ValueError: config values that contradict the arguments, each listed.
    """
    if not args.deepspeed:
        return None
    plugin = DeepSpeedPlugin(hf_ds_config=args.deepspeed)
    micro = args.per_device_train_batch_size
    _fill(
        plugin,
        {
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "train_batch_size": micro * args.gradient_accumulation_steps * num_processes,
            "gradient_clipping": args.max_grad_norm,
            "optimizer.params.lr": args.learning_rate,
            "optimizer.params.betas": [args.adam_beta1, args.adam_beta2],
            "optimizer.params.eps": args.adam_epsilon,
            "optimizer.params.weight_decay": args.weight_decay,
            "scheduler.params.warmup_min_lr": 0,
            "scheduler.params.warmup_max_lr": args.learning_rate,
            "fp16.enabled": bool(args.fp16),
            "bf16.enabled": bool(args.bf16),
        },
    )
    return plugin


def fill_schedule(plugin: DeepSpeedPlugin, *, warmup_steps: int, max_steps: int) -> None:
    """Fill the config scheduler's step counts once the run's steps are planned.

    Raises:
        ValueError: the config's step counts contradict the planned ones, or DeepSpeed's warm-up scheduler
            would get no warm-up step (DeepSpeed refuses 0 deep inside ``initialize``).
    """
    kind = plugin.get_value("scheduler.type")
    if warmup_steps < 1 and plugin.is_auto("scheduler.params.warmup_num_steps") and "Warmup" in str(kind):
        raise ValueError(
            f"The DeepSpeed config's scheduler {kind} needs at least one warm-up step, and the TrainingArguments "
            "give none. Set warmup_steps (or warmup_ratio) above 0, or write warmup_num_steps in the config."
        )
    _fill(
        plugin,
        {
            "scheduler.params.warmup_num_steps": warmup_steps,
            "scheduler.params.total_num_steps": max_steps,
            "scheduler.params.last_batch_iteration": -1,
        },
        only_auto={"scheduler.params.last_batch_iteration"},
    )


def _fill(plugin: DeepSpeedPlugin, values: dict[str, Any], only_auto: set[str] | None = None) -> None:
    mismatches: list[str] = []
    for key, value in values.items():
        written = plugin.get_value(key)
        if written is None:
            continue
        if written == "auto":
            plugin.fill_match(key, must_match=False, **{key: value})
        elif key not in (only_auto or set()) and written != value:
            mismatches.append(f"- {key}: DeepSpeed config {written!r}, TrainingArguments {value!r}")
    if mismatches:
        raise ValueError(
            "TrainingArguments(deepspeed=...): these DeepSpeed config values contradict the TrainingArguments:\n"
            + "\n".join(mismatches)
            + '\nMake them agree, or write "auto" in the DeepSpeed config to take the arguments\' values.'
        )
