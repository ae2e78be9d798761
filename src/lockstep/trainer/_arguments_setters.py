"""transformers' grouped setters of ``TrainingArguments`` (``set_training``, ``set_evaluate``...).

Each sets its group of fields, checks the result as the constructor does (the arguments are rebuilt with the
new values, so an invalid combination raises the constructor's error and leaves the arguments unchanged) and
returns the arguments. Defaults and parameter names are transformers 5.24's; ``TrainingArguments``'s methods
of the same names call these.

Example:
    >>> from lockstep import TrainingArguments
    >>> args = TrainingArguments(output_dir="runs/a").set_training(learning_rate=1e-4, batch_size=32)
    >>> args.learning_rate, args.per_device_train_batch_size
    (0.0001, 32)
"""

from __future__ import annotations

import dataclasses
from typing import Any

# typed loosely: arguments.py calls these functions, so importing it here would be an import cycle
TrainingArguments = Any


def _apply(self: TrainingArguments, **updates: Any) -> TrainingArguments:
    """Rebuild the arguments with ``updates`` (every check of the constructor runs), then take its values."""
    current = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
    rebuilt = type(self)(**{**current, **updates})
    self.__dict__.update(rebuilt.__dict__)
    return self


def _steps(strategy: Any, steps: float, setter: str) -> None:
    if str(getattr(strategy, "value", strategy)).lower() == "steps" and steps == 0:
        raise ValueError(
            f"{setter}(strategy='steps', steps=0) is invalid: set steps >= 1 (or a fraction < 1)."
        )


def set_training(
    self: TrainingArguments,
    learning_rate: float = 5e-5,
    batch_size: int = 8,
    weight_decay: float = 0,
    num_epochs: float = 3,
    max_steps: int = -1,
    gradient_accumulation_steps: int = 1,
    seed: int = 42,
    activation_checkpointing: bool = False,
    gradient_checkpointing: bool | None = None,
) -> TrainingArguments:
    """Set the basic training values (and ``do_train=True``)."""
    if gradient_checkpointing is not None:
        activation_checkpointing = gradient_checkpointing
    return _apply(
        self,
        do_train=True,
        learning_rate=learning_rate,
        per_device_train_batch_size=batch_size,
        weight_decay=weight_decay,
        num_train_epochs=num_epochs,
        max_steps=max_steps,
        gradient_accumulation_steps=gradient_accumulation_steps,
        seed=seed,
        activation_checkpointing=activation_checkpointing,
        gradient_checkpointing=activation_checkpointing,
    )


def set_evaluate(
    self: TrainingArguments,
    strategy: str = "no",
    steps: int = 500,
    batch_size: int = 8,
    accumulation_steps: int | None = None,
    delay: float | None = None,
    loss_only: bool = False,
) -> TrainingArguments:
    """Set when and how to evaluate (``do_eval`` follows ``strategy``)."""
    _steps(strategy, steps, "set_evaluate")
    return _apply(
        self,
        eval_strategy=getattr(strategy, "value", strategy),
        do_eval=str(getattr(strategy, "value", strategy)).lower() != "no",
        eval_steps=steps,
        per_device_eval_batch_size=batch_size,
        eval_accumulation_steps=accumulation_steps,
        eval_delay=0 if delay is None else delay,
        prediction_loss_only=loss_only,
    )


def set_testing(self: TrainingArguments, batch_size: int = 8, loss_only: bool = False) -> TrainingArguments:
    """Set the prediction batch size (and ``do_predict=True``)."""
    return _apply(
        self, do_predict=True, per_device_eval_batch_size=batch_size, prediction_loss_only=loss_only
    )


def set_save(
    self: TrainingArguments,
    strategy: str = "steps",
    steps: int = 500,
    total_limit: int | None = None,
    on_each_node: bool = False,
) -> TrainingArguments:
    """Set when checkpoints are saved and how many are kept."""
    _steps(strategy, steps, "set_save")
    return _apply(
        self,
        save_strategy=getattr(strategy, "value", strategy),
        save_steps=steps,
        save_total_limit=total_limit,
        save_on_each_node=on_each_node,
    )


def set_logging(
    self: TrainingArguments,
    strategy: str = "steps",
    steps: int = 500,
    report_to: str | list[str] = "none",
    level: str = "passive",
    first_step: bool = False,
    nan_inf_filter: bool = False,
    on_each_node: bool = False,
    replica_level: str = "passive",
) -> TrainingArguments:
    """Set when and where the run logs."""
    _steps(strategy, steps, "set_logging")
    return _apply(
        self,
        logging_strategy=getattr(strategy, "value", strategy),
        logging_steps=steps,
        report_to=report_to,
        log_level=level,
        logging_first_step=first_step,
        logging_nan_inf_filter=nan_inf_filter,
        log_on_each_node=on_each_node,
        log_level_replica=replica_level,
    )


def set_push_to_hub(
    self: TrainingArguments,
    model_id: str,
    strategy: str = "every_save",
    token: str | None = None,
    private_repo: bool | None = None,
    always_push: bool = False,
    revision: str | None = None,
) -> TrainingArguments:
    """Refused: lockstep does not upload (``push_to_hub=True`` raises the arguments' NotImplementedError)."""
    return _apply(
        self,
        push_to_hub=True,
        hub_model_id=model_id,
        hub_strategy=strategy,
        hub_token=token,
        hub_private_repo=private_repo,
        hub_always_push=always_push,
        hub_revision=revision,
    )


def set_optimizer(
    self: TrainingArguments,
    name: str = "adamw_torch",
    learning_rate: float = 5e-5,
    weight_decay: float = 0,
    beta1: float = 0.9,
    beta2: float = 0.999,
    epsilon: float = 1e-8,
    args: str | None = None,
) -> TrainingArguments:
    """Set the optimizer and its hyperparameters."""
    return _apply(
        self,
        optim=getattr(name, "value", name),
        learning_rate=learning_rate,
        weight_decay=weight_decay,
        adam_beta1=beta1,
        adam_beta2=beta2,
        adam_epsilon=epsilon,
        optim_args=args,
    )


def set_lr_scheduler(
    self: TrainingArguments,
    name: str = "linear",
    num_epochs: float = 3.0,
    max_steps: int = -1,
    warmup_steps: float = 0,
) -> TrainingArguments:
    """Set the learning-rate schedule and the run's length."""
    return _apply(
        self,
        lr_scheduler_type=getattr(name, "value", name),
        num_train_epochs=num_epochs,
        max_steps=max_steps,
        warmup_steps=warmup_steps,
    )


def set_dataloader(
    self: TrainingArguments,
    train_batch_size: int = 8,
    eval_batch_size: int = 8,
    drop_last: bool = False,
    num_workers: int = 0,
    pin_memory: bool = True,
    persistent_workers: bool = False,
    prefetch_factor: int | None = None,
    multiprocessing_context: str | None = None,
    in_order: bool = True,
    auto_find_batch_size: bool = False,
    ignore_data_skip: bool = False,
    sampler_seed: int | None = None,
) -> TrainingArguments:
    """Set the batch sizes and the data loaders' options."""
    return _apply(
        self,
        per_device_train_batch_size=train_batch_size,
        per_device_eval_batch_size=eval_batch_size,
        dataloader_drop_last=drop_last,
        dataloader_num_workers=num_workers,
        dataloader_pin_memory=pin_memory,
        dataloader_persistent_workers=persistent_workers,
        dataloader_prefetch_factor=prefetch_factor,
        dataloader_multiprocessing_context=multiprocessing_context,
        dataloader_in_order=in_order,
        auto_find_batch_size=auto_find_batch_size,
        ignore_data_skip=ignore_data_skip,
        data_seed=sampler_seed,
    )
