"""What a batch holds: samples, real (non-padding) tokens and padded input elements."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from lockstep._nested import find_batch_size


@dataclass
class BatchCounts:
    """Running counts of the batches handed over during one optimizer step.

    Token counts are kept as tensors (one per batch) and read once, at the end of the step: reading a
    CUDA tensor waits for the device, which must not happen in the middle of a step.
    """

    batches: int = 0
    """Batches handed over."""
    samples: int = 0
    """Samples (the first dimension of the batch)."""
    elements: int = 0
    """``input_ids.numel()`` (padding included: what the model computes on), else the samples."""
    token_sums: list[torch.Tensor | int] = field(default_factory=list)
    """Per batch: ``attention_mask.sum()``, else ``input_ids.numel()``; empty without token inputs."""

    def add(self, batch: Any) -> None:
        """Count one batch."""
        samples = find_batch_size(batch) or 0
        self.batches += 1
        self.samples += samples
        input_ids = _field(batch, "input_ids")
        mask = _field(batch, "attention_mask")
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


def _field(batch: Any, name: str) -> torch.Tensor | None:
    if isinstance(batch, Mapping):
        value = batch.get(name)
        return value if isinstance(value, torch.Tensor) else None
    value = getattr(batch, name, None)  # e.g. a dataclass or named tuple batch
    return value if isinstance(value, torch.Tensor) else None
