"""Filling a DeepSpeed config's ``"auto"`` values at ``prepare``, as Accelerate fills them.

* ``train_micro_batch_size_per_gpu``: the prepared dataloaders' batch size (per process under
  ``split_batches``; the smallest of several, or the largest when ``is_train_batch_min`` is False);
* ``train_batch_size``: micro batch x accumulation steps x processes;
* ``gradient_accumulation_steps``: the Accelerator's;
* ``gradient_clipping``: 1.0 (Accelerate's default);
* the ZeRO bucket sizes from ``model.config.hidden_size`` (or the largest of ``hidden_sizes``);
* ``optimizer.params.lr``/``weight_decay`` from a :class:`DummyOptim`, the warm-up scheduler's parameters
  from a :class:`DummyScheduler`.

The same mistakes are refused as in Accelerate, with what to change: no dataloader to take the micro batch
from, an optimizer both in the config and in the code, a ``DummyOptim`` without a config optimizer, a
``DummyScheduler`` without a ``DummyOptim``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lockstep.backends.deepspeed.placeholders import DummyOptim, DummyScheduler
from lockstep.backends.deepspeed.plugin import DeepSpeedPlugin

_HIDDEN_SIZE_KEYS = (
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
)


@dataclass
class TrainingRun:
    """What ``prepare`` knows that the config's ``"auto"`` values are filled from."""

    batch_sizes: Sequence[int | None]
    """The batch size of each dataloader given to ``prepare`` (None: the loader has none)."""
    accumulation_steps: int
    num_processes: int
    split_batches: bool


def micro_batch_size(plugin: DeepSpeedPlugin, run: TrainingRun, *, training: bool) -> int | None:
    """The micro batch per process, or None when neither the config nor a dataloader gives one."""
    if not plugin.is_auto("train_micro_batch_size_per_gpu"):
        return plugin.get_value("train_micro_batch_size_per_gpu")
    if not run.batch_sizes:
        if not training:
            return None
        raise ValueError(
            'The DeepSpeed config sets train_micro_batch_size_per_gpu to "auto", and prepare() was given no '
            "dataloader to take the batch size from. Prepare the training dataloader together with the model "
            "and optimizer, or write a number for train_micro_batch_size_per_gpu in the DeepSpeed config."
        )
    if any(size is None for size in run.batch_sizes):
        raise ValueError(
            "A dataloader given to prepare() has batch_size None (a batch sampler decides it), so the DeepSpeed "
            'config\'s "auto" train_micro_batch_size_per_gpu cannot be filled. Write a number for it in the '
            "DeepSpeed config."
        )
    sizes = [int(size) for size in run.batch_sizes if size is not None]
    if run.split_batches:
        sizes = [size // run.num_processes for size in sizes]
    return min(sizes) if plugin.is_train_batch_min else max(sizes)


def check_optimizer_and_scheduler(plugin: DeepSpeedPlugin, optimizer: Any, scheduler: Any) -> None:
    """Refuse the combinations of config and code optimizers and schedulers Accelerate refuses."""
    config = plugin.deepspeed_config
    if optimizer is not None:
        if "optimizer" in config and not isinstance(optimizer, DummyOptim):
            raise ValueError(
                f"The DeepSpeed config has an optimizer section and prepare() was given a {type(optimizer).__name__}"
                ": one optimizer only. Remove the config's optimizer, or pass lockstep.utils.DummyOptim(params) "
                "to use the config's."
            )
        if "optimizer" not in config and isinstance(optimizer, DummyOptim):
            raise ValueError(
                "prepare() was given a DummyOptim, and the DeepSpeed config has no optimizer section for it to "
                "stand for. Add an optimizer to the config, or pass a torch optimizer."
            )
    if scheduler is not None:
        if "scheduler" in config and not isinstance(scheduler, DummyScheduler):
            raise ValueError(
                f"The DeepSpeed config has a scheduler section and prepare() was given a {type(scheduler).__name__}"
                ": one scheduler only. Remove the config's scheduler, or pass lockstep.utils.DummyScheduler."
            )
        if (
            isinstance(scheduler, DummyScheduler)
            and "scheduler" not in config
            and scheduler.lr_scheduler_callable is None
        ):
            raise ValueError(
                "prepare() was given a DummyScheduler with no lr_scheduler_callable, and the DeepSpeed config has no "
                "scheduler section. Add a scheduler to the config, or pass lr_scheduler_callable."
            )
        if (
            isinstance(scheduler, DummyScheduler)
            and optimizer is not None
            and not isinstance(optimizer, DummyOptim)
        ):
            raise ValueError(
                "A DummyScheduler goes with a DummyOptim (the config's optimizer). With a torch optimizer, pass a "
                "torch scheduler."
            )


def auto_values(
    plugin: DeepSpeedPlugin, run: TrainingRun, *, model: Any, optimizer: Any, scheduler: Any
) -> dict[str, Any]:
    """The values for the config's ``"auto"`` keys, by dotted key."""
    values: dict[str, Any] = {
        "gradient_clipping": 1.0,
        "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
    }
    micro = micro_batch_size(plugin, run, training=optimizer is not None)
    if micro is None:
        micro = 1  # a model prepared for inference only: DeepSpeed needs a value, and it is never used
    plugin.fill_match(
        "gradient_accumulation_steps", must_match=False, gradient_accumulation_steps=run.accumulation_steps
    )
    values["train_micro_batch_size_per_gpu"] = micro
    values["train_batch_size"] = (
        micro * int(plugin.get_value("gradient_accumulation_steps")) * run.num_processes
    )
    values.update(_hidden_size_values(plugin, model))
    if isinstance(optimizer, DummyOptim):
        values["optimizer.params.lr"] = optimizer.lr
        values["optimizer.params.weight_decay"] = optimizer.weight_decay
    if isinstance(scheduler, DummyScheduler) and scheduler.lr_scheduler_callable is None:
        values.update(_warmup_values(scheduler, run))
    return values


def _hidden_size_values(plugin: DeepSpeedPlugin, model: Any) -> dict[str, Any]:
    auto_keys = [key for key in _HIDDEN_SIZE_KEYS if plugin.is_auto(key)]
    if not auto_keys:
        return {}
    fix = f'Write numbers for {", ".join(auto_keys)} in the DeepSpeed config instead of "auto".'
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(
            f'The DeepSpeed config\'s "auto" bucket sizes come from model.config.hidden_size, and {type(model).__name__} has no config. {fix}'
        )
    hidden = getattr(config, "hidden_size", None)
    if hidden is None and getattr(config, "hidden_sizes", None):
        hidden = max(config.hidden_sizes)
    if hidden is None:
        raise ValueError(f"{type(model).__name__}.config has neither hidden_size nor hidden_sizes. {fix}")
    return {
        "zero_optimization.reduce_bucket_size": hidden * hidden,
        "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
        "zero_optimization.stage3_param_persistence_threshold": 10 * hidden,
    }


def _warmup_values(scheduler: DummyScheduler, run: TrainingRun) -> dict[str, Any]:
    inner = scheduler.optimizer
    defaults = getattr(inner, "defaults", None)
    max_lr = defaults["lr"] if isinstance(defaults, dict) and "lr" in defaults else getattr(inner, "lr", None)
    values: dict[str, Any] = {
        "scheduler.params.warmup_min_lr": 0,
        "scheduler.params.warmup_max_lr": max_lr,
        "scheduler.params.warmup_num_steps": scheduler.warmup_num_steps,
    }
    if scheduler.total_num_steps is not None:
        total = scheduler.total_num_steps
        values["scheduler.params.total_num_steps"] = (
            total if run.split_batches else math.ceil(total / run.num_processes)
        )
    return values
