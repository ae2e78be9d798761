"""The training step of a model that is called on each batch (every layout but a pipeline)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, final

import torch
from torch import nn

from lockstep.accelerator import Accelerator
from lockstep.backends import GlobalLossTerm
from lockstep.trainer._num_items import ItemCounter, MicroBatch
from lockstep.trainer._training_step.base import TrainingStep
from lockstep.trainer._training_step.sequence_split import SequenceSplit

ComputeLoss = Callable[..., torch.Tensor]
"""``fn(model, batch[, num_items_in_batch=n]) -> loss``: the Trainer's ``compute_loss`` (a subclass may override
it, with transformers' signature too: ``num_items_in_batch`` goes by keyword only)."""


@final
class PlainStep(TrainingStep):
    """Forward (the loss from :meth:`compute_loss`), then ``accelerator.backward``, on each micro-batch.

    A counted loss (``num_items_in_batch``) is multiplied by the item counter's ``loss_scale``, since the
    gradients are averaged over the ranks that hold parts of the step's labels. With ``cp_size > 1`` the batch is
    split along the sequence by ``sequence_split`` and the logged loss is the whole sequences' (averaged over the
    ``cp`` ranks). A layer whose model adds a term computed over every rank's batch (expert parallelism's router
    loss: :class:`~lockstep.backends.GlobalLossTerm`) is told of that factor, so the term counts
    once.

    Args:
        accelerator: the Trainer's accelerator.
        model: the user's model (not prepared).
        label_names: where the labels are in a batch.
        loss_func: ``compute_loss_func`` or label smoothing; None when the model computes the loss.
        item_counter: the label counter of the accumulation cycles, or None (see :class:`TrainingStep`).
        sequence_split: splits each batch over the ``cp`` ranks (``cp_size > 1``), else None.
        compute_loss: the loss of one batch (default: :meth:`TrainingStep.loss`).
    """

    def __init__(
        self,
        accelerator: Accelerator,
        model: nn.Module,
        *,
        label_names: Sequence[str],
        loss_func: Callable[..., torch.Tensor] | None,
        item_counter: ItemCounter | None,
        sequence_split: SequenceSplit | None = None,
        compute_loss: ComputeLoss | None = None,
    ) -> None:
        super().__init__(
            accelerator, model, label_names=label_names, loss_func=loss_func, item_counter=item_counter
        )
        self.sequence_split = sequence_split
        self.compute_loss = compute_loss if compute_loss is not None else self.loss
        self._global_term = accelerator.capability(GlobalLossTerm)

    def prepare_model(self, dataset: Any, *, collate: Callable[[list[Any]], Any], batch_size: int) -> None:
        """Nothing: the model is prepared as it is, and reads no example batch."""

    def forward_backward(self, model: nn.Module, micro_batch: MicroBatch) -> torch.Tensor:
        if self.sequence_split is None:
            return self._local_forward_backward(model, micro_batch)
        with self.sequence_split.block(micro_batch.batch) as chunks:  # cp_size > 1: this rank's chunks
            loss = self._local_forward_backward(model, micro_batch._replace(batch=chunks))
        return self.sequence_split.mean_over_ranks(loss)

    def _local_forward_backward(self, model: nn.Module, micro_batch: MicroBatch) -> torch.Tensor:
        if micro_batch.num_items is None:
            loss = self.compute_loss(model, micro_batch.batch)
        else:  # DDP averages the replicas' gradients: a loss over the whole job's tokens undoes it
            scale = self.item_counter.loss_scale  # type: ignore[union-attr]
            with self._multiplied_by(scale):
                loss = self.compute_loss(model, micro_batch.batch, num_items_in_batch=micro_batch.num_items)
            loss = loss * scale
        self.accelerator.backward(loss)
        return loss

    def _multiplied_by(self, scale: float) -> contextlib.AbstractContextManager[None]:
        if self._global_term is None:
            return contextlib.nullcontext()
        return self._global_term.loss_multiplied_by(scale)

    def _writer(self, model: nn.Module) -> nn.Module:
        return self.accelerator.unwrap_model(model, keep_torch_compile=False)
