"""The evaluation loop: predictions and labels of every example, gathered from all processes in order."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from lockstep.accelerator import Accelerator
from lockstep.trainer import _num_items, batches
from lockstep.trainer._process_setup import data_parallel_share

PAD_INDEX = -100


class EvalPrediction:
    """What ``compute_metrics`` receives: NumPy arrays in dataset order (tuples for several outputs), as
    transformers' ``EvalPrediction``: it unpacks as ``(predictions, label_ids[, inputs][, losses])``.

    Attributes:
        predictions: the model outputs without the loss.
        label_ids: the labels.
        inputs: the model's main input (``include_for_metrics=["inputs"]``), else None.
        losses: the loss of each example's batch, one per example (``include_for_metrics=["loss"]``), else
            None.
    """

    def __init__(self, predictions: Any, label_ids: Any, inputs: Any = None, losses: Any = None) -> None:
        self.predictions = predictions
        self.label_ids = label_ids
        self.inputs = inputs
        self.losses = losses
        self.elements = (predictions, label_ids, *(v for v in (inputs, losses) if v is not None))

    def __iter__(self) -> Iterator[Any]:
        return iter(self.elements)

    def __getitem__(self, index: int) -> Any:
        return self.elements[index]

    def __len__(self) -> int:
        return len(self.elements)


@dataclass(frozen=True)
class EvalOptions:
    """What an evaluation run collects, from the arguments."""

    accumulation_steps: int | None = None
    """``eval_accumulation_steps``: gathered batches held on the device before moving to the CPU."""
    include_inputs: bool = False
    include_losses: bool = False
    main_input_name: str = "input_ids"
    batch_metrics: bool = False
    """``batch_eval_metrics``: ``compute_metrics(batch, compute_result=is_last)`` on every batch."""
    keep_predictions: bool = True
    """Hold every prediction (False for an evaluation with batch metrics: nothing is kept)."""
    concat_batches: bool = True
    """``eval_do_concat_batches``: one array per output, else a list of per-batch arrays."""
    preprocess_logits: Callable[[Any, Any], Any] | None = None
    """The Trainer's ``preprocess_logits_for_metrics(logits, labels)``, applied to each batch before gathering."""

    @classmethod
    def from_arguments(cls, args: Any, *, main_input_name: str, predict: bool) -> EvalOptions:
        """The options of ``TrainingArguments`` ``args`` for an evaluation (``predict``: a prediction run)."""
        return cls(
            accumulation_steps=args.eval_accumulation_steps,
            include_inputs="inputs" in args.include_for_metrics,
            include_losses="loss" in args.include_for_metrics,
            main_input_name=main_input_name,
            batch_metrics=args.batch_eval_metrics,
            keep_predictions=predict or not args.batch_eval_metrics,
            concat_batches=args.eval_do_concat_batches,
        )


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
    if isinstance(value, list):  # eval_do_concat_batches=False: one array per batch
        return [_to_numpy(v) for v in value]
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


_KINDS = ("predictions", "labels", "inputs", "losses")


class _Accumulator:
    """This process's loss sum and the gathered predictions, labels (and inputs, losses) of one evaluation.

    Gathered batches wait on the device and move to the CPU every ``accumulation_steps`` batches
    (``eval_accumulation_steps``; None: every batch), so at most that many are held on the device.
    """

    def __init__(self, accumulation_steps: int | None = None) -> None:
        self.loss_sum = 0.0
        self.loss_examples = 0
        self.has_loss = False
        self.values: dict[str, list[Any]] = {kind: [] for kind in _KINDS}
        self.samples = 0
        self.every = accumulation_steps or 1
        self.pending: list[dict[str, Any]] = []
        self.max_pending = 0

    @property
    def predictions(self) -> list[Any]:
        return self.values["predictions"]

    @property
    def labels(self) -> list[Any]:
        return self.values["labels"]

    def add_loss(self, loss: torch.Tensor | None, real_examples: int) -> None:
        """Count ``loss`` (a mean over ``real_examples`` examples) towards the example-weighted mean."""
        if loss is None:
            return
        self.has_loss = True
        self.loss_sum += float(loss.detach().double()) * real_examples
        self.loss_examples += real_examples

    @staticmethod
    def gather(accelerator: Accelerator, values: dict[str, Any]) -> dict[str, Any]:
        """Every process's values of one batch, padded along dim 1 and without the even_batches filler."""
        gathered = {}
        for kind, value in values.items():
            if value is not None:
                if kind != "losses":
                    value = accelerator.pad_across_processes(value, dim=1, pad_index=PAD_INDEX)
                value = accelerator.gather_for_metrics(value)
            gathered[kind] = value
        return gathered

    def add(self, gathered: dict[str, Any]) -> None:
        self.pending.append(gathered)
        self.max_pending = max(self.max_pending, len(self.pending))
        if len(self.pending) >= self.every:
            self.flush()

    def flush(self) -> None:
        """Move the pending gathered batches to the CPU."""
        for gathered in self.pending:
            for kind, value in gathered.items():
                if value is not None:
                    self.values[kind].append(_cpu(value))
            labels = gathered.get("labels")
            if labels is not None:
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
    compute_metrics: Callable[..., dict[str, Any]] | None,
    prediction_loss_only: bool,
    metric_key_prefix: str,
    accumulation_steps: int | None = None,
    options: EvalOptions | None = None,
    prediction_step: Callable[[nn.Module, Any], tuple[Any, Any, Any]] | None = None,
    generate: Callable[[Any], tuple[Any, Any]] | None = None,
) -> PredictionOutput:
    """Run ``model`` over the prepared ``loader``; predictions and labels come back complete and in order.

    ``prediction_step(model, batch) -> (loss, logits, labels)`` replaces the forward of each batch (a Trainer
    subclass's ``prediction_step``). ``generate(batch) -> (predictions, labels)`` replaces the predictions and
    labels of each batch (the Seq2SeqTrainer's generated ids); the loss is still the forward's."""
    options = options or EvalOptions(accumulation_steps=accumulation_steps)
    was_training = model.training
    model.eval()
    started = time.perf_counter()
    collected = _Accumulator(options.accumulation_steps)
    steps, batch_metrics = 0, None
    try:
        for batch in loader:
            steps += 1
            if prediction_step is None:
                generated = generate(batch) if generate is not None else None  # before labels are popped
                loss, real, values = _evaluate_batch(
                    accelerator, model, loader, batch, label_names, compute_loss_func
                )
                if generated is not None:
                    values["predictions"], values["labels"] = generated
            else:
                loss, real, values = _custom_batch(accelerator, loader, batch, prediction_step(model, batch))
            if options.preprocess_logits is not None and values["predictions"] is not None:
                values["predictions"] = options.preprocess_logits(values["predictions"], values["labels"])
            collected.add_loss(loss, real)
            if prediction_loss_only:
                continue
            if options.include_inputs:
                values["inputs"] = _main_input(batch, options.main_input_name)
            if options.include_losses and loss is not None:
                values["losses"] = loss.detach().reshape(1).repeat(_batch_size(batch, values["labels"]))
            gathered = _Accumulator.gather(accelerator, values)
            if options.keep_predictions:
                collected.add(gathered)
            if options.batch_metrics and compute_metrics is not None and gathered["labels"] is not None:
                batch_metrics = compute_metrics(
                    _prediction(gathered), compute_result=accelerator.gradient_state.end_of_dataloader
                )
        collected.flush()
    finally:
        model.train(was_training)
    if collected.has_loss:  # the same on every process: the model gives a loss or it does not
        totals = torch.tensor([collected.loss_sum, float(collected.loss_examples)], dtype=torch.float64)
        totals = accelerator.reduce(totals.to(accelerator.device), reduction="sum").cpu()
        collected.loss_sum, collected.loss_examples = float(totals[0]), int(totals[1])
    if options.batch_metrics:
        compute_metrics = None  # already computed, batch by batch
    output = _finish(
        collected, compute_metrics, metric_key_prefix, time.perf_counter() - started, steps, options
    )
    if batch_metrics:
        output.metrics.update(_prefixed(dict(batch_metrics), metric_key_prefix))
    return output


def _evaluate_batch(
    accelerator: Accelerator,
    model: nn.Module,
    loader: DataLoader,
    batch: Any,
    label_names: Sequence[str],
    compute_loss_func: Callable[..., torch.Tensor] | None,
) -> tuple[torch.Tensor | None, int, dict[str, Any]]:
    """(loss of the real examples, how many this process holds, {"predictions", "labels"}) of one batch."""
    inputs, labels = batches.split_labels(batch, label_names, pop=compute_loss_func is not None)
    with torch.no_grad():
        outputs = batches.call_model(model, inputs)
        if compute_loss_func is not None and labels is not None:
            count = batches.count_items(
                labels, shift=_num_items.loss_shifts_labels(accelerator.unwrap_model(model))
            )
            loss = compute_loss_func(outputs, labels, num_items_in_batch=count)
        else:
            loss = batches.output_loss(outputs)
        size = _batch_size(batch, labels)
        reals = _real_examples(accelerator, loader, size)
        real = reals[data_parallel_share(accelerator)[0]]
        if loss is not None and any(0 < r < size for r in reals):
            # The even_batches filler repeats examples from the start of the data: the loss of the real
            # examples is recomputed without it, so eval_loss is exact. Every process runs this forward
            # (FSDP's forward is a collective); one without real examples runs one row, weighted 0.
            rows = batches.first_rows(batch, max(real, 1), size)
            loss = _loss_of(accelerator, model, rows, label_names, compute_loss_func)
    return loss, real, {"predictions": batches.predictions_of(outputs), "labels": labels}


def _custom_batch(
    accelerator: Accelerator, loader: DataLoader, batch: Any, step: tuple[Any, Any, Any]
) -> tuple[torch.Tensor | None, int, dict[str, Any]]:
    """The result of a custom ``prediction_step`` as :func:`_evaluate_batch` gives it."""
    loss, logits, labels = step
    reals = _real_examples(accelerator, loader, _batch_size(batch, labels))
    return loss, reals[data_parallel_share(accelerator)[0]], {"predictions": logits, "labels": labels}


def _main_input(batch: Any, name: str) -> torch.Tensor:
    """The model's main input of a batch (``include_for_metrics=["inputs"]``)."""
    if isinstance(batch, dict) and isinstance(batch.get(name), torch.Tensor):
        return batch[name]
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor):
        return batch[0]
    keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
    raise ValueError(
        f"TrainingArguments(include_for_metrics=['inputs']) gives compute_metrics the model's main input "
        f"{name!r}, but the batch has none (keys: {keys}). Remove 'inputs' from include_for_metrics."
    )


def _prediction(values: dict[str, Any]) -> EvalPrediction:
    return EvalPrediction(values["predictions"], values["labels"], values.get("inputs"), values.get("losses"))


def _real_examples(accelerator: Accelerator, loader: DataLoader, size: int) -> list[int]:
    """Per data-parallel replica: examples of its current batch that are not even_batches filler.

    Only the last batch has filler. Its real examples fill the replicas in order (the batch of replica
    r holds examples ``r * size ...`` of the last global batch), so every process computes the same list.
    The processes of one tensor-parallel group are one replica: they read the same batch.
    """
    world = data_parallel_share(accelerator)[1]
    remainder = getattr(loader, "remainder", -1)
    if not accelerator.gradient_state.end_of_dataloader or remainder <= 0:  # unknown, or no filler
        return [size] * world
    return [min(size, max(0, remainder - rank * size)) for rank in range(world)]


def _loss_of(
    accelerator: Accelerator,
    model: nn.Module,
    batch: Any,
    label_names: Sequence[str],
    compute_loss_func: Callable[..., torch.Tensor] | None,
) -> torch.Tensor | None:
    inputs, labels = batches.split_labels(batch, label_names, pop=compute_loss_func is not None)
    outputs = batches.call_model(model, inputs)
    if compute_loss_func is not None and labels is not None:
        shift = _num_items.loss_shifts_labels(accelerator.unwrap_model(model))
        return compute_loss_func(outputs, labels, num_items_in_batch=batches.count_items(labels, shift=shift))
    return batches.output_loss(outputs)


def _finish(
    collected: _Accumulator,
    compute_metrics: Callable[[EvalPrediction], dict[str, Any]] | None,
    prefix: str,
    seconds: float,
    steps: int,
    options: EvalOptions,
) -> PredictionOutput:
    join = (
        (lambda chunks: concat_padded(chunks)) if options.concat_batches else (lambda chunks: chunks or None)
    )
    values = {kind: _to_numpy(join(collected.values[kind])) for kind in _KINDS}
    predictions, label_ids = values["predictions"], values["labels"]
    metrics: dict[str, Any] = {}
    if compute_metrics is not None and predictions is not None and label_ids is not None:
        prediction = EvalPrediction(predictions, label_ids, values["inputs"], values["losses"])
        metrics = dict(compute_metrics(prediction))
    if collected.has_loss and collected.loss_examples:
        metrics["loss"] = collected.loss_sum / collected.loss_examples
        samples = collected.loss_examples
    else:
        samples = collected.samples or (len(predictions) if isinstance(predictions, np.ndarray) else 0)
    metrics["runtime"] = round(seconds, 4)
    metrics["samples_per_second"] = round(samples / max(seconds, 1e-9), 3)
    metrics["steps_per_second"] = round(steps / max(seconds, 1e-9), 3)
    return PredictionOutput(predictions=predictions, label_ids=label_ids, metrics=_prefixed(metrics, prefix))


def _prefixed(metrics: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {
        (key if key.startswith(f"{prefix}_") else f"{prefix}_{key}"): _plain(value)
        for key, value in metrics.items()
    }


def _plain(value: Any) -> Any:
    if isinstance(value, (np.generic, torch.Tensor)):
        return value.item()
    return value
