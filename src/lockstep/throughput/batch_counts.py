"""What a batch holds: samples, real (non-padding) tokens and padded input elements."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class BatchCounts:
    """Running counts of the batches handed over during one optimizer step.

    Token counts are kept as tensors (one per batch) and read once, at the end of the step: reading a
    CUDA tensor waits for the device, which must not happen in the middle of a step.
    """

    batches: int = 0
    """Batches handed over."""
    samples: int = 0
    """Samples (the first dimension of the batch's first tensor)."""
    elements: int = 0
    """``input_ids.numel()`` (padding included: what the model computes on), else the samples."""
    token_sums: list[torch.Tensor | int] = field(default_factory=list)
    """Per batch: ``attention_mask.sum()``, else ``input_ids.numel()``; empty without token inputs."""

    def reset(self) -> None:
        """Start counting a new step."""
        self.batches = self.samples = self.elements = 0
        self.token_sums.clear()

    def add(self, batch: Any) -> None:
        """Count one batch."""
        self.batches += 1
        kind = type(batch)
        if (kind is tuple or kind is list) and batch and type(batch[0]) is torch.Tensor:  # (inputs, ...)
            samples = batch[0].shape[0] if batch[0].dim() else 1
            self.samples += samples
            self.elements += samples
            return
        first = first_tensor(batch)
        samples = 0 if first is None else (int(first.shape[0]) if first.dim() > 0 else 1)
        self.samples += samples
        input_ids, mask = _token_fields(batch)
        if input_ids is not None:
            self.elements += input_ids.numel()
        elif mask is not None:
            self.elements += mask.numel()
        else:
            self.elements += samples
        if mask is not None:
            self.token_sums.append(mask.sum())
        elif input_ids is not None:
            self.token_sums.append(input_ids.numel())

    def tokens(self) -> int | None:
        """Real tokens counted (None when no batch had ``input_ids`` or ``attention_mask``)."""
        if not self.token_sums:
            return None
        return sum(int(count) for count in self.token_sums)


def first_tensor(data: Any) -> torch.Tensor | None:
    """The first tensor in a (nested) batch, depth first, in order (as ``find_batch_size`` reads it)."""
    if isinstance(data, torch.Tensor):
        return data
    if isinstance(data, (list, tuple)):
        items: Any = data
    elif isinstance(data, Mapping):
        items = data.values()
    else:
        return None
    for item in items:
        found = first_tensor(item)
        if found is not None:
            return found
    return None


def _token_fields(batch: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(input_ids, attention_mask)`` of a dict-like batch or of a batch object with those attributes."""
    if isinstance(batch, (torch.Tensor, list)) or (
        isinstance(batch, tuple) and not hasattr(batch, "_fields")
    ):
        return None, None
    if isinstance(batch, Mapping):
        input_ids, mask = batch.get("input_ids"), batch.get("attention_mask")
    else:  # e.g. a dataclass batch
        input_ids, mask = getattr(batch, "input_ids", None), getattr(batch, "attention_mask", None)
    return (
        input_ids if isinstance(input_ids, torch.Tensor) else None,
        mask if isinstance(mask, torch.Tensor) else None,
    )
