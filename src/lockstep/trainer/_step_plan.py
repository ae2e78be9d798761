"""How many optimizer steps and epochs a run has, from the loader and the arguments."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
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
        )
    return StepPlan(
        max_steps=math.ceil(float(args.num_train_epochs) * updates),
        num_epochs=math.ceil(float(args.num_train_epochs)),
        updates_per_epoch=updates,
    )


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
