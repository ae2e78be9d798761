"""The training step of a pipelined model (``TrainingArguments(parallelism_config=ParallelismConfig(pp_size=2))``).

A pipelined model is not called for training: one step is ``accelerator.pipeline_step`` (forward and
backward of every micro-batch through the stages), whose loss exists on the rank holding the last stage.
So :class:`PipelineStep`, the Trainer's step when the layout has ``pp_size > 1``:

* traces the model with its **first training batch** (``per_device_train_batch_size`` examples of the
  dataset, collated as the loader does, labels taken out) unless the ``TorchPipelineParallelConfig`` has
  ``example_args``/``example_kwargs`` already: dict batches trace ``model(**inputs)``, tuple batches
  ``model(*inputs)``;
* computes the loss outside the model, on the last stage's outputs: ``compute_loss_func`` (or label
  smoothing) when given, else for a transformers causal LM (``...ForCausalLM``) the next-token
  cross-entropy (``causal_lm_loss``: the model's own loss from ``labels``, which does not trace). Each
  micro-batch's loss is a mean (``num_items_in_batch`` is the micro-batch's label count), so a step's loss
  equals one process's when the micro-batches count the same number of labels (no padding, or
  evenly padded);
* broadcasts the step loss from the last stage to every rank of the pipeline, so logging, ``train_loss``
  and ``TrainOutput`` report the same loss everywhere; evaluation calls the model (the pipelined eval
  path: ``schedule.eval``, outputs on every rank) and applies the same loss function;
* saves the model through the user's model object (``save_pretrained`` with its config, of the stages'
  gathered weights), and loads a model-only checkpoint into this rank's stages.

Other models whose loss comes from the labels inside ``forward`` are refused (pass ``compute_loss_func``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, final

import torch
import torch.distributed as dist
from torch import nn

from lockstep.accelerator import Accelerator
from lockstep.backends import PipelineSchedule
from lockstep.trainer import _transformers_format, batches
from lockstep.trainer._label_smoothing import is_causal_lm
from lockstep.trainer._num_items import MicroBatch
from lockstep.trainer._training_step.base import TrainingStep

_NOT_TRACED = {
    "neftune_noise_alpha": "NEFTune adds its noise in a forward hook of the input embeddings, which the "
    "traced stages do not call",
    "gradient_checkpointing": "the stages are traced graphs of the model, and activation recomputation is "
    "not built into them",
}


def _causal_lm_loss(schedule: PipelineSchedule) -> Callable[..., torch.Tensor]:
    """The pipeline's next-token loss, with the Trainer's loss signature (a per-micro-batch mean: no count)."""

    def loss(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
        return schedule.causal_lm_loss(outputs, labels)

    return loss


def _loss_function(
    model: nn.Module, args: Any, loss_func: Callable[..., torch.Tensor] | None, schedule: PipelineSchedule
) -> Callable[..., torch.Tensor]:
    """The loss of the last stage's outputs and the labels (see the module docs), after refusing the
    arguments a pipelined Trainer does not run (:data:`_NOT_TRACED`)."""
    for name, why in _NOT_TRACED.items():
        if getattr(args, name):
            raise NotImplementedError(
                f"TrainingArguments({name}={getattr(args, name)!r}) with a pipeline (parallelism_config "
                f"pp_size>1) is not built yet: {why}. Turn it off, or train without pp_size."
            )
    if loss_func is not None:
        return loss_func
    if is_causal_lm(model):
        return _causal_lm_loss(schedule)
    raise ValueError(
        f"Trainer with parallelism_config=ParallelismConfig(pp_size>1) needs the loss outside the model: "
        f"{type(model).__name__} computes it from the labels inside forward, which does not trace into "
        "pipeline stages. Pass Trainer(compute_loss_func=fn) with fn(outputs, labels, num_items_in_batch) "
        "returning the mean loss of the last stage's outputs (transformers causal LMs get one by default)."
    )


@final
class PipelineStep(TrainingStep):
    """The training step of a model cut into pipeline stages (see the module docs).

    Args:
        accelerator: the Trainer's accelerator, whose layout has ``pp_size > 1``.
        model: the user's model (not prepared): it is traced, and writes the gathered weights when saved.
        args: the run's arguments (refused: :data:`_NOT_TRACED`).
        label_names: where the labels are in a batch.
        loss_func: ``compute_loss_func`` or label smoothing; None: the causal LM loss (or an error).
    """

    def __init__(
        self,
        accelerator: Accelerator,
        model: nn.Module,
        args: Any,
        *,
        label_names: Sequence[str],
        loss_func: Callable[..., torch.Tensor] | None,
    ) -> None:
        schedule = accelerator.capability(PipelineSchedule)
        if schedule is None:
            raise RuntimeError("PipelineStep needs an Accelerator whose backend runs pipeline schedules.")
        self._schedule = schedule
        # the loss of the last stage's outputs: a per-micro-batch mean, not counted
        loss_func = _loss_function(model, args, loss_func, schedule)
        super().__init__(accelerator, model, label_names=label_names, loss_func=loss_func, item_counter=None)

    def prepare_model(self, dataset: Any, *, collate: Callable[[list[Any]], Any], batch_size: int) -> None:
        """Give the pipeline configuration the first batch of ``dataset`` to trace the model with, unless it has
        example inputs already."""
        handler = self.accelerator.parallelism_config.pp_handler  # type: ignore[union-attr]
        if handler is None or handler.example_args is not None or handler.example_kwargs is not None:
            return
        if hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):
            examples = [dataset[index] for index in range(min(batch_size, len(dataset)))]
        else:
            examples = list(itertools.islice(iter(dataset), batch_size))
        inputs, _ = batches.split_labels(collate(examples), self.label_names, pop=True)
        if isinstance(inputs, Mapping):
            handler.example_kwargs = dict(inputs)
        else:
            handler.example_args = inputs if isinstance(inputs, tuple) else (inputs,)

    def forward_backward(self, model: nn.Module, micro_batch: MicroBatch) -> torch.Tensor:
        """One pipeline step (forward and backward of every pipeline micro-batch) on the batch; the batch's
        mean loss, the same on every rank of the pipeline."""
        batch = micro_batch.batch
        inputs, labels = batches.split_labels(batch, self.label_names, pop=True)
        if labels is None:
            keys = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
            raise ValueError(
                f"A pipelined Trainer step needs labels for the last stage's loss, but the batch has none of "
                f"{self.label_names} (keys: {keys}). Set TrainingArguments(label_names=[...])."
            )
        loss_func = self.loss_func
        assert loss_func is not None

        def microbatch_loss(outputs: Any, target: Any) -> torch.Tensor:
            return loss_func(outputs, target, num_items_in_batch=batches.count_items(target))

        if isinstance(inputs, Mapping):
            loss = self.accelerator.pipeline_step(model, target=labels, loss_fn=microbatch_loss, **inputs)
        else:
            args = inputs if isinstance(inputs, tuple) else (inputs,)
            loss = self.accelerator.pipeline_step(model, *args, target=labels, loss_fn=microbatch_loss)
        return self._from_last_stage(loss)

    def _from_last_stage(self, loss: torch.Tensor | None) -> torch.Tensor:
        """The last stage's loss on every rank of its pipeline: one rank holds it, the others add zero."""
        value = (
            torch.zeros((), device=self.accelerator.device) if loss is None else loss.detach().float().clone()
        )
        mesh = self.accelerator.torch_device_mesh
        assert mesh is not None
        dist.all_reduce(value, group=mesh["pp"].get_group())
        return value

    def load_weights(self, prepared: nn.Module | None, folder: Path) -> None:
        """A model-only checkpoint's weights (``save_only_model``: the whole model's files, written by
        :meth:`save_weights`) into this rank's stages: each rank reads the files and keeps its stages' entries."""
        if prepared is None:
            return super().load_weights(prepared, folder)
        self._schedule.load_whole_model(prepared, _transformers_format.load_model_files(folder))

    def _writer(self, model: nn.Module) -> nn.Module:
        return self.model  # the user's model object writes the stages' gathered weights with its config
