"""The interface of the Trainer's training step: what the loop asks of it, whatever the kind of model."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lockstep.accelerator import Accelerator
from lockstep.integrations.peft import gathered_adapter, is_peft_model
from lockstep.trainer import _num_items, _transformers_format, batches
from lockstep.trainer._num_items import ItemCounter, MicroBatch


class TrainingStep(abc.ABC):
    """One micro-batch of training, the loss of a batch, and how the model's weights go to and from a folder.

    The Trainer holds one, chosen when it is built (:func:`~lockstep.trainer._training_step.training_step_for`),
    and calls it the same way for every kind of model.

    Args:
        accelerator: the Trainer's accelerator.
        model: the user's model (not prepared).
        label_names: where the labels are in a batch.
        loss_func: the loss of the model's outputs and the labels, ``fn(outputs, labels, num_items_in_batch)``,
            in training and evaluation; None when the model computes it (``outputs.loss``).
        item_counter: counts the labels of each accumulation cycle (``num_items_in_batch``); None when the loss
            is a per-batch mean averaged over micro-batches and processes.
    """

    def __init__(
        self,
        accelerator: Accelerator,
        model: nn.Module,
        *,
        label_names: Sequence[str],
        loss_func: Callable[..., torch.Tensor] | None,
        item_counter: ItemCounter | None,
    ) -> None:
        self.accelerator = accelerator
        self.model = model
        self.label_names = list(label_names)
        self.loss_func = loss_func
        self.item_counter = item_counter
        self._model_takes_items = item_counter is not None and _num_items.accepts_loss_kwargs(model)

    @abc.abstractmethod
    def prepare_model(self, dataset: Any, *, collate: Callable[[list[Any]], Any], batch_size: int) -> None:
        """Called once before ``accelerator.prepare``, with the dataset whose first batch (``batch_size``
        examples, collated by ``collate``) the model will see first."""

    def micro_batches(self, loader: Iterable[Any], accumulation_steps: int) -> Iterator[MicroBatch]:
        """The loader's batches, each with the label count of its accumulation cycle when the loss is counted."""
        return _num_items.micro_batches(loader, self.item_counter, accumulation_steps)

    def accumulating(
        self, model: nn.Module, micro_batch: MicroBatch
    ) -> contextlib.AbstractContextManager[Any]:
        """The context of one micro-batch's forward, backward and optimizer step: ``accelerator.accumulate``,
        or for a counted loss the read-ahead cycle's (gradients synchronise on its last batch)."""
        if self.item_counter is None:
            return self.accelerator.accumulate(model)
        return _num_items.counted_micro_step(self.accelerator, model, micro_batch)

    @abc.abstractmethod
    def forward_backward(self, model: nn.Module, micro_batch: MicroBatch) -> torch.Tensor:
        """Forward and backward of one batch of the training loader on the prepared ``model``; returns the loss
        to log for it (undivided by the accumulation steps), the same on every rank that shares the batch."""

    def loss(
        self,
        model: nn.Module,
        batch: Any,
        num_items_in_batch: torch.Tensor | None = None,
        return_outputs: bool = False,
    ) -> Any:
        """The loss of one batch: ``outputs.loss``, or :attr:`loss_func` of the outputs and labels;
        ``num_items_in_batch`` goes to both (to the model when its forward takes loss keyword arguments).
        With ``return_outputs``: ``(loss, outputs)``."""
        loss, outputs, _ = batches.compute_loss(
            model,
            batch,
            label_names=self.label_names,
            compute_loss_func=self.loss_func,
            num_items_in_batch=num_items_in_batch,
            model_takes_items=self._model_takes_items,
        )
        return (loss, outputs) if return_outputs else loss

    def load_weights(self, prepared: nn.Module | None, folder: Path) -> None:
        """A model-only checkpoint's weights (written by :meth:`save_weights`) into the ``prepared`` model, or
        into the user's model before preparation (None)."""
        model = prepared if prepared is not None else self.model
        _transformers_format.load_weights(
            self.accelerator.unwrap_model(model, keep_torch_compile=False), folder
        )

    def save_weights(self, model: nn.Module, folder: Path) -> None:
        """Write ``model``'s whole weights to ``folder``: through ``save_pretrained`` of :meth:`_writer` (its
        config included, so ``from_pretrained`` reads the folder) when it has one, else as safetensors."""
        writer = self._writer(model)
        if not hasattr(writer, "save_pretrained"):
            self.accelerator.save_model(model, str(folder))
            return
        # a peft model saves its adapter alone: gathered by itself, also under ZeRO-3 without
        # stage3_gather_16bit_weights_on_model_save (which get_state_dict needs for the whole model)
        state_dict = (
            gathered_adapter(writer) if is_peft_model(writer) else self.accelerator.get_state_dict(model)
        )
        if self.accelerator.is_main_process:
            writer.save_pretrained(str(folder), state_dict=state_dict, safe_serialization=True)
        self.accelerator.wait_for_everyone()

    @abc.abstractmethod
    def _writer(self, model: nn.Module) -> nn.Module:
        """The model object whose ``save_pretrained`` writes ``model``'s gathered weights."""
