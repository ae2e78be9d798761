"""What the Trainer does with examples and batches: collate them, call the model, get loss and labels.

* Examples that are dicts (torch datasets of dicts, Hugging Face ``datasets`` rows) are collated into a
  dict of tensors; keys the model's ``forward`` does not accept are dropped first
  (``remove_unused_columns``), and ``label``/``label_ids`` are renamed ``labels`` as transformers does.
* Dict batches call ``model(**batch)``. Tuple batches (``TensorDataset``) call ``model(*batch[:-1])``
  and hold the labels last.
* The loss is ``outputs.loss`` (transformers models compute it from the labels in the batch), or
  ``compute_loss_func(outputs, labels, num_items_in_batch=...)``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import default_collate

logger = logging.getLogger("lockstep.trainer")

_LABEL_ALIASES = ("label", "label_ids")


def forward_parameters(model: nn.Module) -> list[str] | None:
    """Names ``model.forward`` accepts by keyword, or None when it names none (``forward(**batch)``).

    A ``**kwargs`` next to named arguments does not count, as in transformers' Trainer: transformers models
    (>= 5) take ``**kwargs`` for attention options, not for data columns.
    """
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    named = [
        name
        for name, p in parameters.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]
    return named or None


def default_label_names(model: nn.Module) -> list[str]:
    """The model's label arguments (``labels``, ``start_positions``...), else ``["labels"]``."""
    names = forward_parameters(model) or []
    found = [n for n in names if "label" in n or n in ("start_positions", "end_positions")]
    return found or ["labels"]


def default_data_collator(examples: Sequence[Any]) -> Any:
    """Stack examples: dicts become a dict of tensors (``label``/``label_ids`` renamed ``labels``).

    Lists of different lengths cannot be stacked; pad them with a collator such as transformers'
    ``DataCollatorWithPadding(tokenizer)``.
    """
    first = examples[0]
    if not isinstance(first, Mapping):
        return default_collate(list(examples))
    batch: dict[str, Any] = {}
    for key in first:
        values = [example[key] for example in examples]
        name = "labels" if key in _LABEL_ALIASES and "labels" not in first else key
        if isinstance(values[0], str):
            batch[name] = values
            continue
        try:
            batch[name] = _stack(values)
        except (ValueError, RuntimeError) as error:
            raise ValueError(
                f"Cannot stack the values of {key!r} into one batch tensor ({error}); examples of different "
                "lengths need padding: pass data_collator=DataCollatorWithPadding(tokenizer) (transformers)."
            ) from None
    return batch


def _stack(values: list[Any]) -> torch.Tensor:
    """One tensor from the values of one key: tensors, NumPy arrays (``set_format("numpy")``) or python values."""
    if isinstance(values[0], torch.Tensor):
        return torch.stack(values)
    if isinstance(values[0], np.ndarray):  # torch.tensor() on a list of arrays is slow and warns
        return torch.from_numpy(np.stack(values))
    return torch.tensor(values)


class RemoveColumnsCollator:
    """Drops example keys the model cannot take, then calls the real collator.

    Args:
        collator: the collator to call on the trimmed examples.
        keep: the keys to keep (the model's forward arguments and the label names).
    """

    def __init__(self, collator: Callable[[list[Any]], Any], keep: Sequence[str]) -> None:
        self.collator = collator
        self.keep = set(keep)
        self._reported = False

    def __call__(self, examples: list[Any]) -> Any:
        if examples and isinstance(examples[0], Mapping):
            dropped = sorted(set(examples[0]) - self.keep)
            if dropped:
                if not self._reported:
                    logger.info("Ignoring columns the model's forward does not accept: %s", dropped)
                    self._reported = True
                examples = [{k: v for k, v in example.items() if k in self.keep} for example in examples]
        return self.collator(examples)


def columns_to_keep(model: nn.Module, label_names: Sequence[str]) -> list[str] | None:
    """The example keys (dataset columns) the model can take: its named forward arguments and the labels;
    None when its forward names none (``forward(**batch)``: every key may be used)."""
    names = forward_parameters(model)
    if names is None:
        return None
    return [*names, *label_names, *_LABEL_ALIASES]


def make_collator(
    model: nn.Module,
    collator: Callable[[list[Any]], Any] | None,
    *,
    remove_unused_columns: bool,
    label_names: Sequence[str],
) -> Callable[[list[Any]], Any]:
    """The collate function of the Trainer's loaders."""
    base = collator if collator is not None else default_data_collator
    keep = columns_to_keep(model, label_names)
    if not remove_unused_columns or keep is None:
        return base
    return RemoveColumnsCollator(base, keep)


def split_labels(batch: Any, label_names: Sequence[str], *, pop: bool) -> tuple[Any, Any]:
    """(model inputs, labels): labels are the ``label_names`` entries of a dict batch, the last item of a
    tuple batch; None when the batch has none. With ``pop`` the labels are taken out of the inputs."""
    if isinstance(batch, Mapping):
        present = [name for name in label_names if name in batch]
        labels = None
        if present:
            labels = batch[present[0]] if len(present) == 1 else tuple(batch[n] for n in present)
        inputs = {k: v for k, v in batch.items() if not (pop and k in present)}
        return inputs, labels
    if isinstance(batch, (list, tuple)) and len(batch) >= 2:
        return tuple(batch[:-1]), batch[-1]
    return batch, None


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model(**inputs)`` for dicts, ``model(*inputs)`` for tuples, else ``model(inputs)``."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


def output_loss(outputs: Any) -> torch.Tensor | None:
    """``outputs.loss`` / ``outputs["loss"]`` when the model computed one."""
    if isinstance(outputs, Mapping):
        return outputs.get("loss")
    return getattr(outputs, "loss", None)


def count_items(labels: Any, *, shift: bool = False) -> int:
    """Labels that count towards the loss (not -100), as transformers' ``num_items_in_batch``; with ``shift``
    (a causal LM, whose loss shifts its labels) over ``labels[..., 1:]``: position 0 is never a target."""
    if isinstance(labels, torch.Tensor):
        if labels.dtype not in (torch.int64, torch.int32):
            return labels.shape[0]
        return int(((labels[..., 1:] if shift else labels) != -100).sum())
    return 0


def compute_loss(
    model: nn.Module,
    batch: Any,
    *,
    label_names: Sequence[str],
    compute_loss_func: Callable[..., torch.Tensor] | None,
    num_items_in_batch: torch.Tensor | None = None,
    model_takes_items: bool = False,
) -> tuple[torch.Tensor, Any, Any]:
    """(loss, outputs, labels) of one batch. ``num_items_in_batch`` (the label count of the accumulation
    cycle) goes to ``compute_loss_func`` and, with ``model_takes_items``, to a dict batch's forward. A
    ``compute_loss_func`` with a ``watching(model, inputs)`` context manager has the forward run inside it."""
    inputs, labels = split_labels(batch, label_names, pop=compute_loss_func is not None)
    if num_items_in_batch is not None and model_takes_items and isinstance(inputs, Mapping):
        inputs = {**inputs, "num_items_in_batch": num_items_in_batch}
    # a loss that reads the forward, not only its outputs (the chunked loss: lm_head's input), watches it
    watching = getattr(compute_loss_func, "watching", None)
    with watching(model, inputs) if watching is not None else contextlib.nullcontext():
        outputs = call_model(model, inputs)
    if compute_loss_func is not None:
        if labels is None:
            raise ValueError(
                f"compute_loss_func needs labels, but the batch has none of {list(label_names)} (keys: "
                f"{sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__}). Set "
                "TrainingArguments(label_names=[...])."
            )
        items = num_items_in_batch if num_items_in_batch is not None else count_items(labels)
        return compute_loss_func(outputs, labels, num_items_in_batch=items), outputs, labels
    loss = output_loss(outputs)
    if loss is None:
        keys = sorted(outputs) if isinstance(outputs, Mapping) else type(outputs).__name__
        raise ValueError(
            f"The model returned no loss (outputs: {keys}). Put the labels in the batch under one of "
            f"{list(label_names)} for a transformers model, or pass Trainer(compute_loss_func=fn) with "
            "fn(outputs, labels, num_items_in_batch) returning the loss."
        )
    return loss, outputs, labels


def first_rows(batch: Any, rows: int, batch_size: int) -> Any:
    """The first ``rows`` examples of a batch (tensors and lists whose first dimension is ``batch_size``)."""
    if isinstance(batch, Mapping):
        return {key: first_rows(value, rows, batch_size) for key, value in batch.items()}
    if isinstance(batch, tuple) or (isinstance(batch, list) and batch and isinstance(batch[0], torch.Tensor)):
        return type(batch)(first_rows(value, rows, batch_size) for value in batch)
    if isinstance(batch, (torch.Tensor, list)) and len(batch) == batch_size:
        return batch[:rows]
    return batch


def predictions_of(outputs: Any) -> Any:
    """The model outputs without the loss: the logits tensor, or a tuple of the remaining tensors."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping):
        values = tuple(v for k, v in outputs.items() if k != "loss" and isinstance(v, torch.Tensor))
    elif isinstance(outputs, (list, tuple)):
        values = tuple(v for v in outputs if isinstance(v, torch.Tensor))
    else:
        return outputs
    return values[0] if len(values) == 1 else values


def input_tokens(batch: Any, mode: str) -> torch.Tensor:
    """Input tokens of a batch (``include_num_input_tokens_seen``): every position of ``input_ids`` for
    ``all``; the positions its ``attention_mask`` marks for ``non_padding``."""
    if isinstance(batch, Mapping):
        ids = batch.get("input_ids")
        mask = batch.get("attention_mask")
    else:
        ids = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
        mask = None
    if not isinstance(ids, torch.Tensor):
        keys = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise ValueError(
            f"TrainingArguments(include_num_input_tokens_seen={mode!r}) counts the tokens of 'input_ids', but the "
            f"batch has none (keys: {keys}). Set include_num_input_tokens_seen='no'."
        )
    if mode == "non_padding" and isinstance(mask, torch.Tensor):
        return mask.sum().to(torch.int64)
    return torch.tensor(ids.numel(), dtype=torch.int64, device=ids.device)
