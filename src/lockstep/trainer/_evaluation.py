"""The evaluation loop: predictions and labels of every example, gathered from all processes in order."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from lockstep.accelerator import Accelerator
from lockstep.trainer import batches

PAD_INDEX = -100


class EvalPrediction(NamedTuple):
    """What ``compute_metrics`` receives: NumPy arrays in dataset order (tuples for several outputs)."""

    predictions: Any
    label_ids: Any


class PredictionOutput(NamedTuple):
    """What ``predict`` returns."""

    predictions: Any
    label_ids: Any
    metrics: dict[str, float]


def _to_numpy(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, tuple):
        return tuple(_to_numpy(v) for v in value)
    tensor = value.detach().cpu()
    if tensor.dtype in (torch.bfloat16, torch.float16):
        tensor = tensor.float()
    return tensor.numpy()


def _pad_to(tensor: torch.Tensor, width: int) -> torch.Tensor:
    if tensor.dim() < 2 or tensor.shape[1] == width:
        return tensor
    shape = list(tensor.shape)
    shape[1] = width - tensor.shape[1]
    return torch.cat([tensor, tensor.new_full(shape, PAD_INDEX)], dim=1)


def concat_padded(chunks: Sequence[Any]) -> Any:
    """Concatenate per-batch results along dim 0, padding dim 1 with -100 where batch widths differ."""
    if not chunks:
        return None
    if isinstance(chunks[0], tuple):
        return tuple(concat_padded([c[i] for c in chunks]) for i in range(len(chunks[0])))
    width = max(c.shape[1] for c in chunks) if chunks[0].dim() >= 2 else 0
    return torch.cat([_pad_to(c, width) for c in chunks], dim=0)


class _Accumulator:
    """This process's loss sum and the gathered predictions and labels of one evaluation run.

    Gathered batches wait on the device and move to the CPU every ``accumulation_steps`` batches
    (``eval_accumulation_steps``; None: every batch), so at most that many are held on the device.
    """

    def __init__(self, accumulation_steps: int | None = None) -> None:
        self.loss_sum = 0.0
        self.loss_examples = 0
        self.has_loss = False
        self.predictions: list[Any] = []
        self.labels: list[Any] = []
        self.samples = 0
        self.every = accumulation_steps or 1
        self.pending: list[tuple[Any, Any]] = []
        self.max_pending = 0

    def add_loss(self, loss: torch.Tensor | None, real_examples: int) -> None:
        """Count ``loss`` (a mean over ``real_examples`` examples) towards the example-weighted mean."""
        if loss is None:
            return
        self.has_loss = True
        self.loss_sum += float(loss.detach().double()) * real_examples
        self.loss_examples += real_examples

    def add(self, accelerator: Accelerator, logits: Any, labels: Any) -> None:
        gathered = []
        for value in (logits, labels):
            if value is not None:
                value = accelerator.pad_across_processes(value, dim=1, pad_index=PAD_INDEX)
                value = accelerator.gather_for_metrics(value)
            gathered.append(value)
        self.pending.append((gathered[0], gathered[1]))
        self.max_pending = max(self.max_pending, len(self.pending))
        if len(self.pending) >= self.every:
            self.flush()

    def flush(self) -> None:
        """Move the pending gathered batches to the CPU."""
        for logits, labels in self.pending:
            if logits is not None:
                self.predictions.append(_cpu(logits))
            if labels is not None:
                labels = _cpu(labels)
                self.labels.append(labels)
                self.samples += len(labels[0] if isinstance(labels, tuple) else labels)
        self.pending.clear()


def _cpu(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return tuple(_cpu(v) for v in value)
    return value.detach().cpu()


def _batch_size(batch: Any, labels: Any) -> int:
    first = labels[0] if isinstance(labels, tuple) else labels
    if isinstance(first, torch.Tensor) and first.dim() > 0:
        return first.shape[0]
    from lockstep.utils import find_batch_size

    return find_batch_size(batch) or 1


def evaluation_loop(
    accelerator: Accelerator,
    model: nn.Module,
    loader: DataLoader,
    *,
    label_names: Sequence[str],
    compute_loss_func: Callable[..., torch.Tensor] | None,
    compute_metrics: Callable[[EvalPrediction], dict[str, Any]] | None,
    prediction_loss_only: bool,
    metric_key_prefix: str,
    accumulation_steps: int | None = None,
) -> PredictionOutput:
    """Run ``model`` over the prepared ``loader``; predictions and labels come back complete and in order."""
    was_training = model.training
    model.eval()
    started = time.perf_counter()
    collected = _Accumulator(accumulation_steps)
    steps = 0
    try:
        for batch in loader:
            steps += 1
            inputs, labels = batches.split_labels(batch, label_names, pop=compute_loss_func is not None)
            with torch.no_grad():
                outputs = batches.call_model(model, inputs)
                if compute_loss_func is not None and labels is not None:
                    count = batches.count_items(labels)
                    loss = compute_loss_func(outputs, labels, num_items_in_batch=count)
                else:
                    loss = batches.output_loss(outputs)
                size = _batch_size(batch, labels)
                reals = _real_examples(accelerator, loader, size)
                real = reals[accelerator.process_index]
                if loss is not None and any(0 < r < size for r in reals):
                    # The even_batches filler repeats examples from the start of the data: the loss of the real
                    # examples is recomputed without it, so eval_loss is exact. Every process runs this forward
                    # (FSDP's forward is a collective); one without real examples runs one row, weighted 0.
                    rows = batches.first_rows(batch, max(real, 1), size)
                    loss = _loss_of(model, rows, label_names, compute_loss_func)
            collected.add_loss(loss, real)
            if not prediction_loss_only:
                collected.add(accelerator, batches.predictions_of(outputs), labels)
        collected.flush()
    finally:
        model.train(was_training)
    if collected.has_loss:  # the same on every process: the model gives a loss or it does not
        totals = torch.tensor([collected.loss_sum, float(collected.loss_examples)], dtype=torch.float64)
        totals = accelerator.reduce(totals.to(accelerator.device), reduction="sum").cpu()
        collected.loss_sum, collected.loss_examples = float(totals[0]), int(totals[1])
    return _finish(collected, compute_metrics, metric_key_prefix, time.perf_counter() - started, steps)


def _real_examples(accelerator: Accelerator, loader: DataLoader, size: int) -> list[int]:
    """Per process: examples of its current batch that are not even_batches filler.

    Only the last batch has filler. Its real examples fill the processes in rank order (the batch of rank
    r holds examples ``r * size ...`` of the last global batch), so every process computes the same list.
    """
    world = accelerator.num_processes
    remainder = getattr(loader, "remainder", -1)
    if not accelerator.gradient_state.end_of_dataloader or remainder <= 0:  # unknown, or no filler
        return [size] * world
    return [min(size, max(0, remainder - rank * size)) for rank in range(world)]


def _loss_of(
    model: nn.Module,
    batch: Any,
    label_names: Sequence[str],
    compute_loss_func: Callable[..., torch.Tensor] | None,
) -> torch.Tensor | None:
    inputs, labels = batches.split_labels(batch, label_names, pop=compute_loss_func is not None)
    outputs = batches.call_model(model, inputs)
    if compute_loss_func is not None and labels is not None:
        return compute_loss_func(outputs, labels, num_items_in_batch=batches.count_items(labels))
    return batches.output_loss(outputs)


def _finish(
    collected: _Accumulator,
    compute_metrics: Callable[[EvalPrediction], dict[str, Any]] | None,
    prefix: str,
    seconds: float,
    steps: int,
) -> PredictionOutput:
    predictions = _to_numpy(concat_padded(collected.predictions))
    label_ids = _to_numpy(concat_padded(collected.labels))
    metrics: dict[str, Any] = {}
    if compute_metrics is not None and predictions is not None and label_ids is not None:
        metrics = dict(compute_metrics(EvalPrediction(predictions=predictions, label_ids=label_ids)))
    if collected.has_loss and collected.loss_examples:
        metrics["loss"] = collected.loss_sum / collected.loss_examples
        samples = collected.loss_examples
    else:
        samples = collected.samples or (len(predictions) if isinstance(predictions, np.ndarray) else 0)
    metrics["runtime"] = round(seconds, 4)
    metrics["samples_per_second"] = round(samples / max(seconds, 1e-9), 3)
    metrics["steps_per_second"] = round(steps / max(seconds, 1e-9), 3)
    prefixed = {
        (key if key.startswith(f"{prefix}_") else f"{prefix}_{key}"): _plain(value)
        for key, value in metrics.items()
    }
    return PredictionOutput(predictions=predictions, label_ids=label_ids, metrics=prefixed)


def _plain(value: Any) -> Any:
    if isinstance(value, (np.generic, torch.Tensor)):
        return value.item()
    return value
