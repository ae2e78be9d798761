"""The sequence split of the Trainer's plain step under context parallelism (``ParallelismConfig(cp_size > 1)``).

The ``cp`` ranks read the same batch; each training step splits it along the sequence inside
``accelerator.maybe_context_parallel`` (each rank keeps a head and a tail chunk) and runs forward and backward
there, as transformers' Trainer does (``_prepare_context_parallel_inputs``):

* ``position_ids`` are made (``0 .. L-1`` per row) when the batch has none: rotary positions must travel with
  the tokens, since a chunk computed from its local length would start at 0.
* The labels are shifted before the split, as ``shift_labels`` (``labels[:, 1:]`` plus -100 at the end): a
  model that shifted them after the split would pair the last token of each chunk with a token of the next
  chunk, or with none.
* An ``attention_mask`` of ones (made when the batch has none and the model takes one) is split with the
  tokens: a transformers model then calls SDPA with ``is_causal=True`` and no mask, where without one it would
  read the split ``position_ids`` (``0..3, 12..15``) as packed sequences and build a mask. Any other mask
  (padding) is refused, since torch's ring attention honours causal masking only.
* The loss is normalised by the label tokens of the whole step (``num_items_in_batch``) and multiplied by
  the ranks whose gradients FSDP averages (data-parallel replicas x ``cp_size``), so that the chunk losses
  add up to the sequence's: the gradient equals one process's. For the logs, each rank's chunk loss is
  averaged over its ``cp`` group, so every ``cp`` rank logs the whole batch's loss.

The caller's batch is not changed: the split tensors are copies (``num_input_tokens_seen`` still counts the
whole sequence). Evaluation and prediction run without context parallelism: each ``cp`` rank evaluates whole
sequences, and the gathered predictions and ``eval_loss`` count each sample once (over data-parallel
replicas only).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lockstep.accelerator import Accelerator
from lockstep.backends import ContextParallel
from lockstep.trainer.arguments import TrainingArguments

IGNORE_INDEX = -100
_SPLIT_KEYS = ("input_ids", "labels", "shift_labels", "position_ids", "attention_mask")
"""The batch tensors split along the sequence (dimension 1)."""


def _takes(model: nn.Module, name: str) -> bool:
    """Whether ``model.forward`` accepts keyword ``name`` (by name, or through ``**kwargs``)."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    if name in parameters:
        return parameters[name].kind is not inspect.Parameter.POSITIONAL_ONLY
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def _check_setup(model: nn.Module, args: TrainingArguments, *, counted: bool, cp_size: int) -> None:
    """Refuse, before training, what cannot split a sequence over the ``cp`` ranks."""
    where = f"Trainer with ParallelismConfig(cp_size={cp_size})"
    name = type(model).__name__
    missing = [key for key in ("position_ids", "shift_labels") if not _takes(model, key)]
    if missing:
        raise ValueError(
            f"{where} splits each sequence over the cp ranks and calls the model with "
            f"{' and '.join(missing)}, which {name}.forward does not accept: rotary positions must be those "
            "of the whole sequence, and labels must be shifted before the split. Use a transformers causal LM "
            "(its forward takes them), or set cp_size=1."
        )
    if args.label_smoothing_factor:
        raise NotImplementedError(
            f"{where} and label_smoothing_factor={args.label_smoothing_factor}: the smoothed loss shifts the "
            "labels after the sequence is split, pairing each chunk's last token with the wrong label. Set "
            "label_smoothing_factor=0, or cp_size=1."
        )
    if not counted:
        raise ValueError(
            f"{where} normalises the loss by the label tokens of the whole step (num_items_in_batch), so that "
            f"the cp ranks' chunk losses add up to the sequence's; {name} does not take loss keyword arguments "
            "(its accepts_loss_kwargs is False, or its forward has no **kwargs). Use a model whose loss takes "
            "num_items_in_batch and shift_labels (transformers causal LMs), or set cp_size=1."
        )
    if args.neftune_noise_alpha:
        raise NotImplementedError(
            f"{where} and neftune_noise_alpha={args.neftune_noise_alpha}: NEFTune scales its noise by the "
            "sequence length, which each cp rank sees as its chunk's. Leave neftune_noise_alpha unset, or set "
            "cp_size=1."
        )


class SequenceSplit:
    """Splits each training batch along the sequence over the ``cp`` ranks and averages the logged loss.

    Args:
        accelerator: runs ``maybe_context_parallel``; its mesh's ``cp`` group averages the loss.
        cp_size: the ranks a sequence is split over.
        with_mask: give the model an ``attention_mask`` of ones (the model takes one).
    """

    def __init__(self, accelerator: Accelerator, cp_size: int, *, with_mask: bool) -> None:
        self.accelerator = accelerator
        self.cp_size = cp_size
        self.with_mask = with_mask
        self._group = accelerator.torch_device_mesh["cp"].get_group()

    @contextlib.contextmanager
    def block(self, batch: Any) -> Iterator[dict[str, Any]]:
        """Run forward and backward inside: yields this rank's chunks of ``batch`` (with ``shift_labels``
        and ``position_ids``), split inside ``maybe_context_parallel``."""
        inputs = split_inputs(batch, self.cp_size, with_mask=self.with_mask)
        buffers = [inputs[key] for key in _SPLIT_KEYS if key in inputs]
        with self.accelerator.maybe_context_parallel(
            buffers=buffers, buffer_seq_dims=[1] * len(buffers), no_restore_buffers=set(buffers)
        ):
            yield inputs

    def mean_over_ranks(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss of the whole sequences: this rank's chunk loss averaged over its ``cp`` group (the same
        value on every ``cp`` rank, as logged)."""
        total = loss.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self._group)
        return total / self.cp_size


def split_inputs(batch: Any, cp_size: int, *, with_mask: bool = True) -> dict[str, Any]:
    """The model inputs before the split: copies of ``input_ids``, ``labels`` and an ``attention_mask`` of
    ones (``with_mask``), ``shift_labels`` and ``position_ids`` (made when absent); the other entries as
    they are. Raises on what cannot be split."""
    where = f"Trainer with ParallelismConfig(cp_size={cp_size})"
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"{where} needs dict batches (input_ids, labels), got a {type(batch).__name__}. Return dicts "
            "from the dataset or the data_collator, or set cp_size=1."
        )
    ids, labels = batch.get("input_ids"), batch.get("labels")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or not isinstance(labels, torch.Tensor):
        raise ValueError(
            f"{where} splits the batch's input_ids and labels (batch, sequence) along the sequence; the "
            f"batch has {_describe(batch)}. Give both as 2-D tensors, or set cp_size=1."
        )
    length = ids.shape[1]
    if length % (2 * cp_size):
        raise ValueError(
            f"{where}: the batch's sequences have {length} tokens, which do not split into 2 * cp_size = "
            f"{2 * cp_size} equal chunks (each cp rank holds a head and a tail chunk). Make every "
            f"sequence a multiple of {2 * cp_size} tokens long (pack or truncate the texts to such a "
            "length)."
        )
    _check_attention_mask(batch.get("attention_mask"), where)
    inputs = {key: value for key, value in batch.items() if key not in _SPLIT_KEYS}
    _refuse_other_sequence_tensors(inputs, ids.shape, where)
    shift_labels = batch.get("shift_labels")
    if not isinstance(shift_labels, torch.Tensor):
        shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
    positions = batch.get("position_ids")
    if not isinstance(positions, torch.Tensor):
        positions = torch.arange(length, device=ids.device).expand(ids.shape[0], -1)
    split = [ids, labels, shift_labels, positions]
    if with_mask:
        split.append(torch.ones_like(ids))
    # copies: the split happens in place, and the caller's batch stays whole
    inputs.update(
        {
            key: value.clone(memory_format=torch.contiguous_format)
            for key, value in zip(_SPLIT_KEYS, split, strict=False)
        }
    )
    return inputs


def _check_attention_mask(mask: Any, where: str) -> None:
    """Only a mask of ones (or none) can go: causal masking alone says the same."""
    if mask is None or (isinstance(mask, torch.Tensor) and bool(mask.all())):
        return
    kind = f"a {type(mask).__name__}" if not isinstance(mask, torch.Tensor) else "zeros (padding)"
    raise NotImplementedError(
        f"{where}: the batch's attention_mask holds {kind}. torch's ring attention splits the sequence over "
        "the cp ranks and honours causal masking only, so padded or masked positions would be attended to. "
        "Pack the texts into full-length sequences (no padding, no attention_mask), or set cp_size=1."
    )


def _refuse_other_sequence_tensors(inputs: dict[str, Any], shape: torch.Size, where: str) -> None:
    """A tensor the size of the sequences that is not split (token_type_ids...) would not match the chunks."""
    unsplit = [
        key
        for key, value in inputs.items()
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == tuple(shape)
    ]
    if unsplit:
        raise NotImplementedError(
            f"{where} splits input_ids, labels, shift_labels and position_ids along the sequence, but the batch "
            f"also holds {unsplit} of the same (batch, sequence) shape, which would not match the chunks. "
            "Remove them from the batch (remove_unused_columns, the data_collator), or set cp_size=1."
        )


def _describe(batch: Mapping[str, Any]) -> str:
    return (
        ", ".join(
            f"{key}: {tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}"
            for key, value in batch.items()
        )
        or "no keys"
    )


def sequence_split_for(
    accelerator: Accelerator, model: nn.Module, args: TrainingArguments, *, counted: bool, has_loss_func: bool
) -> SequenceSplit | None:
    """The Trainer's :class:`SequenceSplit` when ``cp_size > 1`` (checked first), else None.

    Args:
        accelerator: the Trainer's accelerator.
        model: the user's model.
        args: the run's arguments.
        counted: whether the loss is normalised by ``num_items_in_batch`` (the Trainer's item counter).
        has_loss_func: whether the user gave ``compute_loss_func``.
    """
    if accelerator.capability(ContextParallel) is None:
        return None
    config = accelerator.parallelism_config
    if has_loss_func:
        raise NotImplementedError(
            f"Trainer(compute_loss_func=...) with ParallelismConfig(cp_size={config.cp_size}): the function "
            "receives the labels after the sequence is split, and a causal LM loss that shifts them would pair "
            "each chunk's last token with the wrong label. Leave the loss to the model (it takes shift_labels), "
            "or set cp_size=1."
        )
    _check_setup(model, args, counted=counted, cp_size=config.cp_size)
    return SequenceSplit(accelerator, config.cp_size, with_mask=_takes(model, "attention_mask"))
