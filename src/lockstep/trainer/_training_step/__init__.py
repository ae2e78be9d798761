"""The Trainer's training step: what differs between training a model that is called on each batch and one
cut into pipeline stages, behind one interface (:class:`TrainingStep`) chosen once, by
:func:`training_step_for`, when the Trainer is built. The loop calls it without asking which kind it holds:

* :class:`PlainStep` (every layout but a pipeline): each micro-batch is a forward (the loss from
  ``outputs.loss``, or ``compute_loss_func``/label smoothing of the outputs) and ``accelerator.backward``;
  the loss is normalised by the labels of the accumulation cycle when the model or the loss function takes
  ``num_items_in_batch``; with ``cp_size > 1`` each batch is split along the sequence by its
  :class:`~lockstep.trainer._training_step.sequence_split.SequenceSplit`.
* :class:`PipelineStep` (``pp_size > 1``): the stages are traced with the first batch; each micro-batch of
  the loader is one ``accelerator.pipeline_step`` through the stages, with the loss outside the model,
  broadcast from the last stage (see :mod:`lockstep.trainer._training_step.pipeline`).

Both give evaluation the loss function they train with (:attr:`TrainingStep.loss_func`) and say how the
model's weights are written (``save_model``) and read back (a model-only checkpoint).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lockstep.accelerator import Accelerator
from lockstep.backends import PipelineSchedule
from lockstep.layers.long_context import trainer_loss
from lockstep.layers.long_context.options import CHUNKED_NLL
from lockstep.trainer import _num_items
from lockstep.trainer._label_smoothing import LabelSmoothingLoss, is_causal_lm
from lockstep.trainer._training_step.base import TrainingStep
from lockstep.trainer._training_step.pipeline import PipelineStep
from lockstep.trainer._training_step.plain import ComputeLoss, PlainStep
from lockstep.trainer._training_step.sequence_split import sequence_split_for

__all__ = ["PipelineStep", "PlainStep", "TrainingStep", "training_step_for"]


def training_step_for(
    accelerator: Accelerator,
    model: nn.Module,
    args: Any,
    *,
    label_names: Sequence[str],
    compute_loss_func: Callable[..., torch.Tensor] | None,
    compute_loss: ComputeLoss | None = None,
) -> TrainingStep:
    """The Trainer's step for ``model`` under ``accelerator``'s layout, after refusing what it cannot run.

    This is the one place that asks whether the layout cuts models into pipeline stages.

    Args:
        accelerator: the Trainer's accelerator.
        model: the user's model (not prepared).
        args: the run's ``TrainingArguments``.
        label_names: where the labels are in a batch.
        compute_loss_func: the user's loss of the outputs and labels, or None.
        compute_loss: the Trainer's ``compute_loss`` (which a subclass may override), used by the plain step.
    """
    loss_func = compute_loss_func
    if args.loss_type == CHUNKED_NLL:
        config = accelerator.parallelism_config
        loss_func = trainer_loss(
            model,
            distributed_type=str(
                getattr(accelerator.distributed_type, "value", accelerator.distributed_type)
            ),
            parallel_sizes={size: getattr(config, size, 1) for size in ("cp_size", "pp_size")},
            compute_loss_func=compute_loss_func,
            label_smoothing_factor=args.label_smoothing_factor,
        )
    elif args.label_smoothing_factor > 0:
        loss_func = LabelSmoothingLoss(args.label_smoothing_factor, shift_labels=is_causal_lm(model))
    if accelerator.capability(PipelineSchedule) is not None:
        return PipelineStep(accelerator, model, args, label_names=label_names, loss_func=loss_func)
    item_counter = _num_items.item_counter(
        accelerator, model, args, loss_func=loss_func, label_names=label_names
    )
    sequence_split = sequence_split_for(
        accelerator,
        model,
        args,
        counted=item_counter is not None,
        has_loss_func=compute_loss_func is not None,
    )
    return PlainStep(
        accelerator,
        model,
        label_names=label_names,
        loss_func=loss_func,
        item_counter=item_counter,
        sequence_split=sequence_split,
        compute_loss=compute_loss,
    )
