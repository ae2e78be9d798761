"""Callbacks: code that watches (and steers) the Trainer's loop, with transformers' event names.

The loop, as the events see it::

    on_init_end
    on_train_begin
    for each epoch:
        on_epoch_begin
        for each optimizer step (gradient_accumulation_steps micro-batches):
            on_step_begin
            (forward, backward per micro-batch; on_substep_end after each but the last)
            on_pre_optimizer_step; optimizer.step(); on_optimizer_step
            on_step_end             -> control.should_log / should_evaluate / should_save
            on_log, on_evaluate, on_save   (when the control flags say so)
        on_epoch_end
    on_train_end

Each event receives ``(args, state, control, **kwargs)`` with ``model``, ``optimizer``,
``lr_scheduler``, ``train_dataloader``, ``eval_dataloader`` and, for ``on_log``/``on_evaluate``,
``logs``/``metrics``. A callback may set fields of ``control`` (e.g. ``should_training_stop``).

Example:
    >>> class StopAt(TrainerCallback):
    ...     def on_step_end(self, args, state, control, **kwargs):
    ...         if state.global_step == 10:
    ...             control.should_training_stop = True
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lockstep.trainer.arguments import TrainingArguments

logger = logging.getLogger("lockstep.trainer")

EVENTS = (
    "on_init_end",
    "on_train_begin",
    "on_epoch_begin",
    "on_step_begin",
    "on_substep_end",
    "on_pre_optimizer_step",
    "on_optimizer_step",
    "on_step_end",
    "on_log",
    "on_evaluate",
    "on_predict",
    "on_save",
    "on_epoch_end",
    "on_train_end",
)


@dataclass
class TrainerState:
    """Where training is; saved in every checkpoint (``register_for_checkpointing``).

    Attributes:
        epoch: epochs done, as a float (1.5 is half-way through the second epoch).
        global_step: optimizer steps done.
        max_steps: optimizer steps of the whole run.
        num_train_epochs: epochs of the whole run.
        log_history: every dict passed to ``log`` (training losses, evaluation metrics).
    """

    epoch: float = 0.0
    global_step: int = 0
    max_steps: int = 0
    num_train_epochs: int = 0
    logging_steps: float = 500
    eval_steps: float | None = None
    save_steps: float = 500
    train_batch_size: int = 0
    total_train_batch_size: int = 0
    num_processes: int = 1
    log_history: list[dict[str, Any]] = field(default_factory=list)
    best_metric: float | None = None
    """The best value of ``metric_for_best_model`` so far."""
    best_global_step: int | None = None
    """The step of that evaluation."""
    best_model_checkpoint: str | None = None
    """The checkpoint folder of that step, once saved (kept by save_total_limit rotation)."""
    num_input_tokens_seen: int = 0
    """Input tokens trained on by all processes (``include_num_input_tokens_seen``)."""
    loss_since_log: float = 0.0
    """Sum of the step losses since the last logged loss (kept in checkpoints, so resumed logs match)."""
    steps_since_log: int = 0
    total_loss: float = 0.0
    """Sum of every step loss of the run (for ``train_loss``)."""
    stateful_callbacks: dict[str, Any] = field(default_factory=dict)
    """States of the callbacks that export one (transformers' ``ExportableState``), taken at each save."""
    trial_name: str | None = None
    """The hyperparameter-search trial this run is (None outside a search)."""
    trial_params: dict[str, Any] | None = None
    """That trial's hyperparameters."""
    is_world_process_zero: bool = True
    is_local_process_zero: bool = True

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            if key not in ("is_world_process_zero", "is_local_process_zero") and hasattr(self, key):
                setattr(self, key, value)


@dataclass
class TrainerControl:
    """Flags the callbacks set to steer the loop; the loop resets each after acting on it."""

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False

    def _new_step(self) -> None:
        self.should_save = self.should_evaluate = self.should_log = False

    def state(self) -> dict[str, Any]:
        """transformers' exported state (saved in checkpoints' ``stateful_callbacks``)."""
        return {"args": dataclasses.asdict(self), "attributes": {}}


class TrainerCallback:
    """Base class of callbacks: override the events you need (each does nothing by default).

    Every event has the signature ``(self, args, state, control, **kwargs)``; returning a
    :class:`TrainerControl` replaces the loop's control object (transformers' convention).
    """

    def on_init_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> Any:
        pass

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> Any:
        pass

    def on_epoch_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> Any:
        pass

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> Any:
        pass

    def on_substep_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> Any:
        pass

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> Any:
        pass

    def on_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> Any:
        pass

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> Any:
        pass

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> Any:
        pass

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> Any:
        pass

    def on_predict(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> Any:
        pass

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> Any:
        pass

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> Any:
        pass

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> Any:
        pass


def _every(steps: float | None, global_step: int, max_steps: int) -> bool:
    """Whether ``global_step`` is a multiple of ``steps`` (a fraction of ``max_steps`` when < 1)."""
    if not steps:
        return False
    interval = max(1, round(steps * max_steps)) if steps < 1 else int(steps)
    return global_step % interval == 0


class DefaultFlowCallback(TrainerCallback):
    """Sets ``should_log``/``should_evaluate``/``should_save`` from the strategies of the arguments."""

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> Any:
        step, total = state.global_step, state.max_steps
        if args.logging_strategy == "steps" and (
            _every(args.logging_steps, step, total) or (args.logging_first_step and step == 1)
        ):
            control.should_log = True
        if args.eval_strategy == "steps" and _every(args.eval_steps, step, total) and args.eval_delay <= step:
            control.should_evaluate = True
        if args.save_strategy == "steps" and _every(args.save_steps, step, total):
            control.should_save = True
        if step >= total:
            control.should_training_stop = True
            if args.save_strategy == "steps":
                control.should_save = (
                    True  # the run's last state is always kept (epoch saves come at epoch end)
                )
        return control

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> Any:
        if args.logging_strategy == "epoch":
            control.should_log = True
        if args.eval_strategy == "epoch" and args.eval_delay <= state.epoch:
            control.should_evaluate = True
        if args.save_strategy == "epoch":
            control.should_save = True
        return control


class CallbackHandler:
    """Calls every callback's event in order; the Trainer owns one."""

    def __init__(self, callbacks: list[TrainerCallback | type[TrainerCallback]]) -> None:
        self.callbacks: list[TrainerCallback] = []
        for callback in callbacks:
            self.add_callback(callback)

    def add_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        """Add a callback (an instance, or a class to instantiate); a second one of a class is warned about."""
        instance = callback() if isinstance(callback, type) else callback
        if not isinstance(instance, TrainerCallback):
            raise TypeError(
                f"add_callback() got {type(instance).__name__}; callbacks must subclass lockstep.TrainerCallback."
            )
        if any(type(existing) is type(instance) for existing in self.callbacks):
            logger.warning(
                "Adding a second %s; the callbacks are now %s.", type(instance).__name__, self.callbacks
            )
        self.callbacks.append(instance)

    def pop_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> TrainerCallback | None:
        """Remove and return a callback (or the first of a class); None when absent."""
        for existing in self.callbacks:
            if existing is callback or (isinstance(callback, type) and type(existing) is callback):
                self.callbacks.remove(existing)
                return existing
        return None

    def remove_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        self.pop_callback(callback)

    def call_event(
        self, event: str, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        for callback in self.callbacks:
            result = getattr(callback, event)(args, state, control, **kwargs)
            if isinstance(result, TrainerControl):
                control = result
        return control

    # transformers' handler methods that scripts call directly (trainer_qa.py: on_evaluate, on_predict)
    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, metrics: dict[str, float]
    ) -> TrainerControl:
        control.should_evaluate = False
        return self.call_event("on_evaluate", args, state, control, metrics=metrics)

    def on_predict(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, metrics: dict[str, float]
    ) -> TrainerControl:
        return self.call_event("on_predict", args, state, control, metrics=metrics)

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs: dict[str, float]
    ) -> TrainerControl:
        control.should_log = False
        return self.call_event("on_log", args, state, control, logs=logs)

    def __repr__(self) -> str:
        return ", ".join(type(c).__name__ for c in self.callbacks)
