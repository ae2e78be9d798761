"""Ulysses sequence parallelism, by hand: the head all-to-all around attention, the batch split, the loss.

Each of the ``sp`` ranks of a sequence-parallel group holds a contiguous ``1/sp`` of every row's sequence,
for all heads. Around attention an all-to-all turns ``(seq/sp, heads)`` into ``(seq, heads/sp)`` for the
query, key and value; SDPA runs causally over the whole sequence for this rank's heads; a second all-to-all
turns the output back into ``(seq/sp, heads)``. Everything outside attention is per token and stays local.

Used in a loop (every rank of the group reads the same whole batch)::

    enable_ulysses(model, group)  # model's attention becomes "lockstep_ulysses"
    items = count_label_tokens(labels)  # over the step's micro-batches, before the split
    shard = ulysses_shard(input_ids, labels, group=group)  # labels shifted first, then split
    logits = model(input_ids=shard.input_ids, position_ids=shard.position_ids, use_cache=False).logits
    loss = ulysses_loss(logits, shard.labels, num_items_in_batch=items)
    loss.backward()
    ...  # further micro-batches
    sum_sequence_gradients(model, group)  # before optimizer.step()

Why these pieces:

* The labels are shifted on the whole sequence before the split, so that the last token of rank ``r``
  predicts the first token of rank ``r + 1`` (shifting each shard would drop one target per boundary and
  give the last token a wrong one). :func:`ulysses_loss` therefore does not shift again.
* ``position_ids`` are the global ones (rank ``r`` holds ``r * seq/sp ...``), so rotary embeddings are those
  of one process.
* The loss of one process is the sum of every token's loss over the label tokens of the whole step. Each rank
  returns its own tokens' sum divided by that count (not its own mean: the shards hold unequal numbers of
  label tokens). Every rank runs backward on its own share; the all-to-all's backward carries each share's
  gradient to the ranks whose activations it depends on, so together the ranks run the backward of the
  sum of the shares, i.e. of one process's loss. The replicated weights' gradients are then partial sums:
  they are summed over the group (:func:`sum_sequence_gradients`), not averaged. (Under gradient averaging,
  as DDP does, scale each rank's loss by ``sp`` instead.)

Key/value heads fewer than ``sp`` are refused rather than repeated: heads and key/value heads must both be
divisible by ``sp``. The model's attention then sees no mask (the implementation is unknown to transformers'
mask builders): a padded ``attention_mask`` or a packed row is refused by :func:`ulysses_shard`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lockstep.errors import UsageError

ULYSSES_ATTENTION = "lockstep_ulysses"
"""The name :func:`enable_ulysses` registers in transformers' ``AttentionInterface``."""
IGNORE_INDEX = -100

_groups: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()
"""The sequence-parallel group of every module of a model :func:`enable_ulysses` was given."""


@dataclass(frozen=True)
class UlyssesShard:
    """This rank's contiguous part of a batch: ``(rows, seq/sp)`` each, ``labels`` already shifted."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor | None


def _group_size(group: Any) -> int:
    return dist.get_world_size(group)


def _check_heads(heads: int, kv_heads: int, sp: int) -> None:
    if heads % sp or kv_heads % sp:
        raise UsageError(
            f"Ulysses sequence parallelism splits the attention heads over the sp={sp} ranks: the model has "
            f"{heads} query heads and {kv_heads} key/value heads, and both must be divisible by sp. Choose an "
            f"sp_size that divides {kv_heads} (key/value heads are not repeated)."
        )


def _seq_to_heads(x: torch.Tensor, group: Any, sp: int) -> torch.Tensor:
    """``(b, heads, seq/sp, d)`` on each rank -> ``(b, heads/sp, seq, d)``: this rank's heads, the whole sequence."""
    b, h, s, d = x.shape
    send = x.reshape(b, sp, h // sp, s, d).permute(1, 0, 2, 3, 4).contiguous()
    received = _all_to_all(send, group)  # [i] = rank i's sequence chunk of this rank's heads
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * s, d)


def _heads_to_seq(x: torch.Tensor, group: Any, sp: int) -> torch.Tensor:
    """``(b, seq, heads/sp, d)`` -> ``(b, seq/sp, heads, d)``: this rank's sequence chunk, every head."""
    b, s, h, d = x.shape
    send = x.reshape(b, sp, s // sp, h, d).permute(1, 0, 2, 3, 4).contiguous()
    received = _all_to_all(send, group)  # [i] = rank i's heads of this rank's sequence chunk
    return received.permute(1, 2, 0, 3, 4).reshape(b, s // sp, sp * h, d)


def _all_to_all(send: torch.Tensor, group: Any) -> torch.Tensor:
    """Chunk ``i`` of dim 0 goes to rank ``i``; chunk ``i`` of the result came from rank ``i`` (with autograd)."""
    return _AllToAll.apply(send, group)


class _AllToAll(torch.autograd.Function):
    """The equal-split all-to-all; its own adjoint (the gradient of chunk ``i`` goes back to rank ``i``).

    Written here because ``torch.distributed.nn.functional.all_to_all_single`` is deprecated (a
    ``FutureWarning``) and its replacement lives in the private ``_functional_collectives``.
    """

    @staticmethod
    def forward(ctx: Any, send: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        send = send.contiguous()  # and the result too: torch.empty_like keeps a strided input's layout
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)
        return received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()  # a permuted gradient arrives strided; empty_like would keep its strides
        sent_back = torch.empty_like(grad)
        dist.all_to_all_single(sent_back, grad, group=ctx.group)
        return sent_back, None


def ulysses_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface function: SDPA between the two all-to-alls of the module's group."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    group = _groups.get(module)
    if group is None:
        raise UsageError(
            f"{type(module).__name__} runs the '{ULYSSES_ATTENTION}' attention but was not given a sequence-"
            "parallel group: call lockstep.layers.long_context.enable_ulysses(model, group) on the whole model."
        )
    if attention_mask is not None:
        raise UsageError(
            "Ulysses sequence parallelism runs causal attention over the whole sequence and takes no attention "
            f"mask; got one of shape {tuple(attention_mask.shape)}. Pass unpadded, unpacked rows."
        )
    sp = _group_size(group)
    _check_heads(query.shape[1], key.shape[1], sp)
    query, key, value = (_seq_to_heads(t, group, sp) for t in (query, key, value))
    output, _ = sdpa_attention_forward(module, query, key, value, None, **kwargs)
    return _heads_to_seq(output, group, sp), None


def enable_ulysses(model: nn.Module, group: Any = None) -> nn.Module:
    """Give a transformers ``model`` Ulysses attention over ``group`` (default: the whole world); returns it.

    Registers :data:`ULYSSES_ATTENTION` in transformers' ``AttentionInterface`` and switches the model to it
    (``set_attn_implementation``). Refuses a model whose heads or key/value heads ``sp`` does not divide.
    """
    from transformers import AttentionInterface

    if not dist.is_initialized():
        raise UsageError("enable_ulysses needs an initialised process group (torch.distributed).")
    group = group if group is not None else dist.group.WORLD
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise UsageError(
            f"enable_ulysses takes a transformers model (with .config and .set_attn_implementation); "
            f"got {type(model).__name__}."
        )
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    _check_heads(heads, kv_heads, _group_size(group))
    AttentionInterface.register(ULYSSES_ATTENTION, ulysses_attention_forward)
    for module in model.modules():
        _groups[module] = group
    model.set_attn_implementation(ULYSSES_ATTENTION)
    return model


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Position ``t`` gets the label of ``t + 1``; the last position gets ``-100`` (no target)."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)


def count_label_tokens(*labels: torch.Tensor) -> torch.Tensor:
    """The targets of unshifted ``labels`` (the model's own count): the positions after the first not ``-100``."""
    return sum(tensor[:, 1:].ne(IGNORE_INDEX).sum() for tensor in labels)  # type: ignore[return-value]


def ulysses_shard(
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    group: Any = None,
) -> UlyssesShard:
    """This rank's contiguous ``1/sp`` of the sequence: ``input_ids``, global ``position_ids``, shifted labels.

    Every rank of ``group`` passes the same whole batch. The labels are shifted on the whole sequence first.
    The sequence length must be divisible by ``sp``; an ``attention_mask`` with zeros (padding) and
    ``position_ids`` that restart inside a row (packing) are refused.
    """
    group = group if group is not None else dist.group.WORLD
    sp, rank = _group_size(group), dist.get_rank(group)
    rows, length = input_ids.shape
    if length % sp:
        raise UsageError(
            f"Ulysses sequence parallelism splits each row's {length} tokens over sp={sp} ranks: the "
            f"sequence length must be divisible by {sp}; pad the rows to a multiple of it."
        )
    if attention_mask is not None and not bool(attention_mask.all()):
        raise UsageError(
            "Ulysses sequence parallelism runs attention without a mask: this batch's attention_mask has "
            "zeros (padding). Pass unpadded rows of one length (a padding mask is not built yet)."
        )
    if position_ids is None:
        position_ids = torch.arange(length, device=input_ids.device).expand(rows, length)
    elif bool((position_ids[:, 1:] <= position_ids[:, :-1]).any()):
        raise UsageError(
            "position_ids restart inside a row (packed documents): packed batches under Ulysses sequence "
            "parallelism are not supported yet, and plain causal attention would train across documents."
        )
    part = slice(rank * (length // sp), (rank + 1) * (length // sp))
    shifted = shift_labels(labels)[:, part] if labels is not None else None
    return UlyssesShard(input_ids[:, part], position_ids[:, part], shifted)


def ulysses_loss(
    logits: torch.Tensor, shifted_labels: torch.Tensor, *, num_items_in_batch: torch.Tensor | int
) -> torch.Tensor:
    """This rank's share of the loss: its tokens' cross-entropy summed, over the label tokens of the step.

    ``shifted_labels`` come from :func:`ulysses_shard` (not shifted again here); ``num_items_in_batch`` is
    :func:`count_label_tokens` of the step's whole (unsplit) micro-batches. The shares of the group add up to
    one process's loss; backward on each rank's share, then :func:`sum_sequence_gradients`.
    """
    total = nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        shifted_labels.reshape(-1).to(logits.device),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return total / num_items_in_batch


def sum_sequence_gradients(model: nn.Module, group: Any = None) -> None:
    """Sum the gradients of ``model``'s parameters over the sequence-parallel ``group`` (in place)."""
    group = group if group is not None else dist.group.WORLD
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if _group_size(group) == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for same in by_dtype.values():  # one all-reduce per dtype
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, group=group)
        offset = 0
        for grad in same:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()
