"""The Trainer's loss with ``TrainingArguments(loss_type="chunked_nll")``: the chunked loss of a causal LM.

The Trainer calls it as a loss function of the outputs and labels; around the training forward it first
enters :meth:`ChunkedCausalLMLoss.watching`, which takes the hidden states ``lm_head`` receives and lets it
project the last position only (:func:`~lockstep.layers.long_context.skip_lm_head`). A forward it did not
watch (evaluation, which needs the logits for its predictions) has its logits: the loss is then their
cross-entropy, as the model's own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, final

import torch
from torch import nn
from torch.nn import functional

from lockstep.layers.long_context._capture import LMHeadInput, skip_lm_head
from lockstep.layers.long_context._chunked_loss import (
    DEFAULT_CHUNK_SIZE,
    IGNORE_INDEX,
    chunked_causal_lm_loss,
)

_SCALED_LOGITS = ("logit_scale", "logits_scaling")
"""Config fields of models whose forward rescales the logits after ``lm_head`` (Cohere, Granite): the chunked
loss does not apply them."""


@final
class ChunkedCausalLMLoss:
    """``fn(outputs, labels, num_items_in_batch)`` for the Trainer, from the hidden states of the forward it
    watched.

    Args:
        model: the user's causal LM (not prepared): a transformers ``*ForCausalLM`` with an ``lm_head``.
        chunk_size: kept positions projected at a time.

    Raises:
        ValueError: ``model`` is not a causal LM with an ``nn.Linear`` ``lm_head``, or its forward changes the
            logits in a way the chunked loss does not (a logit scale).
    """

    def __init__(self, model: nn.Module, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        self.lm_head = output_projection(model)
        config = getattr(model, "config", None)
        self.softcap: float | None = getattr(config, "final_logit_softcapping", None)
        self.chunk_size = chunk_size
        self._seen: LMHeadInput | None = None
        self._shift_labels: torch.Tensor | None = None

    @contextlib.contextmanager
    def watching(self, model: nn.Module, inputs: Any) -> Iterator[None]:
        """The context of the forward whose loss comes next: while gradients are recorded (training)
        ``lm_head`` projects the last position only; its input is kept for :meth:`__call__`."""
        shifted = inputs.get("shift_labels") if isinstance(inputs, Mapping) else None
        with skip_lm_head(self.lm_head, keep_logits=not torch.is_grad_enabled()) as seen:
            yield
        self._seen, self._shift_labels = seen, shifted

    def __call__(
        self, outputs: Any, labels: torch.Tensor, num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        # The Trainer's label count is a tensor; an int is its count of this batch's unshifted labels (no
        # counter: DeepSpeed, evaluation), where the model's own loss is the mean over the shifted labels.
        items = num_items_in_batch if isinstance(num_items_in_batch, torch.Tensor) else None
        seen, shifted = self._seen, self._shift_labels
        self._seen = self._shift_labels = None
        targets, shift = (labels, True) if shifted is None else (shifted, False)
        if seen is None:
            return _full_loss(_logits_of(outputs), targets, items, shift=shift)
        return chunked_causal_lm_loss(
            seen.hidden_states,
            self.lm_head,
            targets,
            num_items_in_batch=items,
            shift=shift,
            chunk_size=self.chunk_size,
            softcap=self.softcap,
        )


def output_projection(model: nn.Module) -> nn.Linear:
    """``model``'s ``lm_head`` (``get_output_embeddings()``), after checking the chunked loss can replace its
    loss."""
    name = type(model).__name__
    causal = getattr(model, "loss_type", None) == "ForCausalLM" or name.endswith("ForCausalLM")
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else getattr(model, "lm_head", None)
    if not causal or not isinstance(head, nn.Linear):
        raise ValueError(
            f"TrainingArguments(loss_type='chunked_nll') needs a causal LM with an nn.Linear lm_head (a "
            f"transformers *ForCausalLM); {name} is {'not a causal LM' if not causal else 'without one'}. Use "
            "loss_type='nll' (the model's own loss)."
        )
    config = getattr(model, "config", None)
    for field in _SCALED_LOGITS:
        if getattr(config, field, None) not in (None, 1, 1.0):
            raise ValueError(
                f"TrainingArguments(loss_type='chunked_nll'): {name} rescales its logits after lm_head "
                f"(config.{field}={getattr(config, field)!r}), which the chunked loss does not do yet. Use "
                "loss_type='nll'."
            )
    return head


def _logits_of(outputs: Any) -> torch.Tensor:
    logits = outputs.get("logits") if isinstance(outputs, Mapping) else getattr(outputs, "logits", None)
    if not isinstance(logits, torch.Tensor):
        raise ValueError(
            f"loss_type='chunked_nll': the model's outputs ({type(outputs).__name__}) hold no logits."
        )
    return logits


def _full_loss(
    logits: torch.Tensor, labels: torch.Tensor, items: torch.Tensor | None, *, shift: bool
) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` of logits that were built (a forward the loss did not watch)."""
    if shift:
        labels = functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    flat = logits.float().reshape(-1, logits.shape[-1])
    targets = labels.reshape(-1).to(flat.device)
    if items is None:
        return functional.cross_entropy(flat, targets, ignore_index=IGNORE_INDEX)
    return functional.cross_entropy(flat, targets, ignore_index=IGNORE_INDEX, reduction="sum") / items.to(
        flat.device
    )


_BUILT_FOR = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_MPS")
"""The distributed types the Trainer's chunked loss is built for: one process, DDP and tensor parallelism,
where ``lm_head``'s weight is whole, or split by vocabulary rows, on every rank after the forward."""


def trainer_loss(
    model: nn.Module,
    *,
    distributed_type: str,
    parallel_sizes: Mapping[str, int],
    compute_loss_func: Any,
    label_smoothing_factor: float,
) -> ChunkedCausalLMLoss:
    """The Trainer's loss for ``loss_type="chunked_nll"``, after refusing what it is not built for.

    Args:
        model: the user's model (not prepared).
        distributed_type: the accelerator's (``"NO"``, ``"MULTI_CPU"``, ``"FSDP"``...).
        parallel_sizes: the layout's ``cp_size`` and ``pp_size`` (1 when absent); any ``tp_size`` is built.
        compute_loss_func: the user's loss function, or None.
        label_smoothing_factor: the arguments' label smoothing.

    Raises:
        ValueError: a loss function or label smoothing asked for too, or a model that is not a causal LM.
        NotImplementedError: a layout the chunked loss is not built for yet.
    """
    if compute_loss_func is not None:
        raise ValueError(
            "TrainingArguments(loss_type='chunked_nll') and Trainer(compute_loss_func=...) each give the loss; "
            "pass one of them."
        )
    if label_smoothing_factor > 0:
        raise NotImplementedError(
            f"TrainingArguments(loss_type='chunked_nll', label_smoothing_factor={label_smoothing_factor}): "
            "label smoothing in the chunked loss is not built yet. Set label_smoothing_factor=0 or "
            "loss_type='nll'."
        )
    for size in ("cp_size", "pp_size"):  # tp_size: the loss is vocabulary-parallel (loss_parallel)
        if parallel_sizes.get(size, 1) > 1:
            raise NotImplementedError(
                f"TrainingArguments(loss_type='chunked_nll') with ParallelismConfig({size}="
                f"{parallel_sizes[size]}): the chunked loss is not built yet for {size} > 1. Use loss_type='nll'."
            )
    if distributed_type not in _BUILT_FOR:
        raise NotImplementedError(
            f"TrainingArguments(loss_type='chunked_nll') under {distributed_type}: the chunked loss reads the "
            "lm_head weight after the forward, where this backend holds it sharded; not built yet (one process "
            "and DDP are). Use loss_type='nll'."
        )
    return ChunkedCausalLMLoss(model)
