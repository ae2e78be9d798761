"""``label_smoothing_factor``: the cross-entropy of the logits with smoothed targets, as a loss function
with ``compute_loss_func``'s signature, so training and evaluation use it alike."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional

from lockstep.trainer import batches

IGNORE_INDEX = -100


class LabelSmoothingLoss:
    """``(1 - eps) * nll + eps * mean over classes of -log p``, over the labels that are not -100
    (torch's ``cross_entropy(label_smoothing=eps)``). Causal LMs predict the next token, so their logits
    and labels are shifted by one, as the model's own loss does.

    Args:
        epsilon: the smoothing factor, in (0, 1).
        shift_labels: compare the logits at position t with the label at t + 1 (causal LMs).
    """

    def __init__(self, epsilon: float, *, shift_labels: bool) -> None:
        self.epsilon = epsilon
        self.shift_labels = shift_labels

    def __call__(
        self, outputs: Any, labels: torch.Tensor, num_items_in_batch: int | torch.Tensor | None = None
    ) -> torch.Tensor:
        logits = _logits(outputs)
        if self.shift_labels:
            logits, labels = logits[..., :-1, :], labels[..., 1:]
        loss = functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            labels.reshape(-1),
            ignore_index=IGNORE_INDEX,
            label_smoothing=self.epsilon,
            reduction="sum" if isinstance(num_items_in_batch, torch.Tensor) else "mean",
        )
        if not isinstance(num_items_in_batch, torch.Tensor):  # a batch's own count (evaluation): the mean
            return loss
        # The accumulation cycle's label count (of the whole job with average_tokens_across_devices).
        return loss / num_items_in_batch.to(loss.device)


def _logits(outputs: Any) -> torch.Tensor:
    logits = outputs.get("logits") if isinstance(outputs, dict) else getattr(outputs, "logits", None)
    if logits is None:
        logits = batches.predictions_of(outputs)
        logits = logits[0] if isinstance(logits, tuple) else logits
    if not isinstance(logits, torch.Tensor):
        raise ValueError(
            f"TrainingArguments(label_smoothing_factor>0) needs logits from the model; it returned "
            f"{type(outputs).__name__}. Return logits (e.g. outputs.logits), or smooth in compute_loss_func."
        )
    return logits


def is_causal_lm(model: nn.Module) -> bool:
    return type(model).__name__.endswith("ForCausalLM")
