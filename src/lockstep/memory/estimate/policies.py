"""What each activation policy keeps for backward, by a forward pass on the meta device.

``lockstep estimate-memory --activation-policies none,full,op`` builds the model on the meta device (no
memory, no weights), applies each policy to its blocks as training would
(:mod:`lockstep.memory.activation_policy`), runs one forward on a meta batch and counts, storage by storage,
what stays alive for backward (:mod:`lockstep.memory.activation_meter`). The count is the one the meter makes
on real tensors, so the estimate follows any architecture, in the model's own dtype; it covers the
activations after the forward, not the recomputation's peak in backward (one block's activations more).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from lockstep.config.activation_policy import parse_activation_policy
from lockstep.errors import UsageError
from lockstep.memory.activation_meter import KeptEstimate, trace_kept_activations


class _FusedAttention(TorchFunctionMode):
    """Attention on the meta device as on a real one: ``scaled_dot_product_attention`` runs its fused kernel
    (which keeps the output and a log-sum-exp for backward, as flash attention does on CPU and CUDA), where on
    meta it would take the math path (which keeps the s x s attention weights)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not nn.functional.scaled_dot_product_attention or not args[0].is_meta:
            return func(*args, **kwargs)
        return _fused_attention(*args, **kwargs)


class _DenseBatch(TorchDispatchMode):
    """Data-dependent yes/no questions on the meta device (``mask.all()``: transformers asks whether the batch
    is padded or packed, to skip building a mask) answered as for a dense batch of full sequences: yes."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if (
            func is torch.ops.aten._local_scalar_dense.default
            and args[0].is_meta
            and args[0].dtype == torch.bool
        ):
            return True
        return func(*args, **(kwargs or {}))


def _fused_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    # grouped-query attention: the fused kernels take the fewer key/value heads as they are
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )[0]


def _is_transformers_layer(module: nn.Module) -> bool:
    return any(cls.__name__ == "GradientCheckpointingLayer" for cls in type(module).__mro__)


def model_blocks(model: nn.Module, block_class: str | None = None) -> list[nn.Module]:
    """The blocks a policy wraps: modules of class ``block_class``, else transformers' checkpointing layers,
    else the ``_no_split_modules`` classes."""
    if block_class is not None:
        blocks = [m for m in model.modules() if m is not model and type(m).__name__ == block_class]
        if not blocks:
            present = ", ".join(sorted({type(m).__name__ for m in model.modules()}))
            raise UsageError(
                f"--block-class {block_class!r}: {type(model).__name__} has no such module; its classes: {present}."
            )
        return blocks
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if _is_transformers_layer(m)]
    blocks = blocks or [m for m in model.modules() if m is not model and type(m).__name__ in names]
    if not blocks:
        raise UsageError(
            f"{type(model).__name__} names no repeated layers (no _no_split_modules): pass --block-class with "
            "the class of its blocks."
        )
    return blocks


def policy_estimates(
    model: nn.Module,
    *,
    policies: Sequence[str],
    batch_size: int,
    seq_len: int,
    input_shape: Sequence[int] | None = None,
    block_class: str | None = None,
) -> list[KeptEstimate]:
    """Bytes each policy keeps for backward after one forward of a meta batch.

    Args:
        model: built on the meta device (:func:`lockstep.memory.estimate.model_source.build_model`).
        policies: names of :mod:`lockstep.memory.activation_policy` (``none``, ``full``, ``every_2``...).
        batch_size, seq_len: the batch of ``input_ids`` a transformers model gets.
        input_shape: for other models: the shape of the one float input (batch first).
        block_class: the class of the blocks, when the model does not name them.

    Raises:
        UsageError: an unknown policy, no blocks, no input shape for a non-transformers model, or a forward
            that fails on the meta device.
    """
    try:
        parsed = [parse_activation_policy(name, owner="--activation-policies") for name in policies]
    except ValueError as error:
        raise UsageError(str(error)) from None
    model_blocks(model, block_class)  # fails early with the usage message
    if input_shape is not None:
        batch = torch.zeros(*input_shape, device="meta")

        def forward(m: nn.Module) -> object:
            return m(batch.clone())  # made under the meter: the batch counts when the blocks keep it

    elif hasattr(model, "config"):
        ids = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")

        def forward(m: nn.Module) -> object:
            m.config.use_cache = False  # training: no KV cache
            return m(input_ids=ids.clone())

    else:
        raise UsageError(
            f"{type(model).__name__} is not a transformers model: give --input-shape (e.g. 32,384) for its input."
        )
    try:
        with _FusedAttention(), _DenseBatch():
            return trace_kept_activations(
                model, blocks=lambda m: model_blocks(m, block_class), policies=parsed, forward=forward
            )
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as error:
        raise UsageError(
            f"the forward of {type(model).__name__} failed on the meta device ({type(error).__name__}: {error}); "
            "check --input-shape, or estimate without --activation-policies."
        ) from None
