"""How many optimizer steps and epochs a run has, from the loader and the arguments."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from lockstep.trainer.arguments import TrainingArguments
from lockstep.trainer.callbacks import TrainerState


@dataclass(frozen=True)
class StepPlan:
    """The run's length, per process (so the number of processes and accumulation count)."""

    max_steps: int
    num_epochs: int
    """Epochs to iterate (``sys.maxsize`` for a loader without a length)."""
    updates_per_epoch: int | None
    """Optimizer steps in one epoch (None for a loader without a length)."""
    resized: ResizedEpoch | None = None
    """The epoch a resume on another number of processes continues (its steps are not a whole epoch's)."""
    batches_per_epoch: int | None = None
    """Micro-batches in one epoch per process (None for a loader without a length)."""

    def epoch_at(self, global_step: int) -> float:
        """The epoch (with its fraction) reached after ``global_step`` optimizer steps."""
        if not self.updates_per_epoch:
            return 0.0
        part = self.resized
        if part is None:
            return global_step / self.updates_per_epoch
        done = global_step - part.step
        if done <= part.updates:
            left = 1 - float(part.consumed)
            return part.epoch + float(part.consumed) + done * left / max(part.updates, 1)
        return part.epoch + 1 + (done - part.updates) / self.updates_per_epoch


@dataclass(frozen=True)
class ResizedEpoch:
    """Where a run resumed on another number of processes: the rest of the epoch takes ``updates`` steps of
    the new size, and the epochs after it whole epochs of the new size."""

    step: int
    """The optimizer step the checkpoint was saved at."""
    epoch: int
    consumed: Fraction
    """The part of the epoch's samples consumed before the resume."""
    updates: int
    """Optimizer steps left in the epoch on the new number of processes."""


def plan_steps(args: TrainingArguments, loader: Any, *, num_processes: int, dataset: Any) -> StepPlan:
    """The plan of a run over ``loader`` (the prepared training loader of ``dataset``)."""
    try:
        batches_per_epoch = len(loader)
    except TypeError:
        batches_per_epoch = None
    if batches_per_epoch is None:
        if args.max_steps < 0:
            raise ValueError(
                "The training set has no length (an iterable dataset), so epochs cannot be counted: set "
                "TrainingArguments(max_steps=...)."
            )
        return StepPlan(max_steps=args.max_steps, num_epochs=sys.maxsize, updates_per_epoch=None)
    if batches_per_epoch == 0:
        raise ValueError(
            f"The training loader yields no batch on each of the {num_processes} processes (dataset of "
            f"{len(dataset)} examples, per_device_train_batch_size={args.per_device_train_batch_size}, "
            f"dataloader_drop_last={args.dataloader_drop_last})."
        )
    updates = math.ceil(batches_per_epoch / args.gradient_accumulation_steps)
    if args.max_steps > 0:
        return StepPlan(
            max_steps=args.max_steps,
            num_epochs=math.ceil(args.max_steps / updates),
            updates_per_epoch=updates,
            batches_per_epoch=batches_per_epoch,
        )
    return StepPlan(
        max_steps=math.ceil(float(args.num_train_epochs) * updates),
        num_epochs=math.ceil(float(args.num_train_epochs)),
        updates_per_epoch=updates,
        batches_per_epoch=batches_per_epoch,
    )


def resized_plan(
    args: TrainingArguments, loader: Any, whole: StepPlan, global_step: int, dataset: Any
) -> StepPlan | None:
    """The plan of a run whose ``loader`` was just restored from a checkpoint saved on another number of
    processes (None when it was not): the steps left in the resumed epoch, then whole epochs of the new size
    (``whole``, planned before the load), up to ``num_train_epochs`` counted in samples of ``dataset``, or
    ``max_steps``.

    Example: 64 samples, 12 per step on 3 processes, resumed on 2 (8 per step) after 2 steps: the 40 samples
    left take 5 steps, the second epoch 8, so 2 epochs end at step 15 (not 12 and not 16).
    """
    resize = getattr(loader, "resized", None)
    full = whole.updates_per_epoch
    if resize is None or not full:
        return None
    if whole.batches_per_epoch:  # the accumulation may have changed at the load (elastic_keep_global_batch)
        full = math.ceil(whole.batches_per_epoch / args.gradient_accumulation_steps)
    part = ResizedEpoch(
        step=global_step,
        epoch=resize.epoch,
        consumed=Fraction(resize.samples_consumed, max(len(dataset), 1)),
        updates=math.ceil(len(loader) / args.gradient_accumulation_steps),
    )
    if args.max_steps > 0:
        beyond = max(0, args.max_steps - global_step - part.updates)
        num_epochs = part.epoch + 1 + math.ceil(beyond / full)
        return StepPlan(args.max_steps, num_epochs, full, resized=part)
    left = Fraction(str(float(args.num_train_epochs))) - part.epoch - part.consumed  # epochs of data left
    rest = 1 - part.consumed  # of the resumed epoch
    if left <= rest:
        steps = math.ceil(left / rest * part.updates) if rest > 0 else 0
    else:
        steps = part.updates + math.ceil((left - rest) * full)
    return StepPlan(global_step + max(0, steps), whole.num_epochs, full, resized=part)


def record_plan(
    state: TrainerState, plan: StepPlan, args: TrainingArguments, *, batch_size: int, num_processes: int
) -> None:
    """Write the plan and the batch sizes into ``state`` (as transformers' TrainerState holds them)."""
    state.train_batch_size = batch_size
    state.total_train_batch_size = batch_size * args.gradient_accumulation_steps * num_processes
    state.max_steps = plan.max_steps
    state.num_train_epochs = plan.num_epochs if plan.updates_per_epoch is not None else 0
    state.logging_steps, state.save_steps = args.logging_steps, args.save_steps
    state.eval_steps = args.eval_steps
