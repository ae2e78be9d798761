"""The causal-LM loss without the full logits: ``lm_head`` and cross-entropy chunk by chunk, with recompute.

The model's own loss (transformers' ``ForCausalLMLoss``) projects every position onto the vocabulary, upcasts
the logits to fp32 and takes the cross-entropy: ``tokens x vocab`` floats in forward, as many again for their
gradient in backward (16k tokens x a 248k vocabulary is 16 GB in fp32). Here the positions whose label is
``ignore_index`` are dropped first, then each chunk of ``chunk_size`` kept positions is projected, reduced to
its log-sum-exp and target logit, and thrown away; backward projects each chunk again to form its gradient.
No tensor larger than ``chunk_size x vocab`` is allocated; the cost is one more ``lm_head`` matmul. Under
tensor parallelism, where ``lm_head``'s weight is split by vocabulary rows, each rank projects onto its own
rows only (:mod:`~lockstep.layers.long_context._vocab_parallel`): the logits are never gathered.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional

from lockstep.layers.long_context._vocab_parallel import (
    VocabShard,
    all_reduce,
    local_projection,
    local_targets,
)

IGNORE_INDEX = -100
DEFAULT_CHUNK_SIZE = 1024
"""Kept positions per chunk: 1024 x a 151k vocabulary is 620 MB of fp32 logits per chunk."""


def chunked_causal_lm_loss(
    hidden_states: torch.Tensor,
    lm_head: nn.Module | torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = IGNORE_INDEX,
    shift: bool = True,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    softcap: float | None = None,
) -> torch.Tensor:
    """The causal-LM cross-entropy of ``lm_head(hidden_states)`` against ``labels``, never building the logits.

    It equals transformers' ``ForCausalLMLoss`` (the loss ``LlamaForCausalLM(labels=...)`` returns): labels
    shifted left by one, logits upcast to fp32, the sum of the token losses divided by ``num_items_in_batch``
    when it is given (the Trainer's exact accumulation: the label tokens of the whole accumulation cycle and
    of every process), else their mean. Gradients flow to ``hidden_states`` and to the weight (and bias) of
    ``lm_head``, which may be tied to the input embeddings. A weight split by vocabulary rows over
    tensor-parallel ranks (a DTensor ``Shard(0)``: transformers' plan for ``lm_head``) is used where it lies:
    each rank projects onto its rows, and the ranks exchange one float per position (vocabulary-parallel).

    Args:
        hidden_states: the final hidden states (after the last norm), ``(batch, sequence, hidden)`` or
            ``(tokens, hidden)``.
        lm_head: the output projection: an ``nn.Linear`` (or a module with ``weight`` and ``bias``), or its
            ``(vocab, hidden)`` weight.
        labels: token ids, ``hidden_states``' shape without the last dimension; ``ignore_index`` is no target.
        bias: the projection's bias when ``lm_head`` is a weight tensor.
        num_items_in_batch: divide the summed token losses by this count instead of taking their mean.
        ignore_index: the label that marks a position without a target.
        shift: shift ``labels`` left by one along the sequence (position ``t`` predicts token ``t + 1``), as
            transformers does; False when they are shifted already (a batch's ``shift_labels``).
        chunk_size: kept positions projected at a time (a chunk's logits are ``chunk_size x vocab`` floats).
        softcap: the model's ``final_logit_softcapping`` (Gemma 2): logits become ``softcap * tanh(z / softcap)``.

    Returns:
        The loss, an fp32 scalar.

    Raises:
        TypeError: ``lm_head`` is neither a tensor nor a module with a 2-D ``weight``.
        ValueError: shapes that do not match, or a ``chunk_size`` below 1.
        NotImplementedError: a DTensor weight laid out otherwise than by vocabulary rows (FSDP's shards).

    Example:
        >>> import torch
        >>> head = torch.nn.Linear(8, 50, bias=False)
        >>> hidden, labels = torch.randn(2, 6, 8), torch.randint(0, 50, (2, 6))
        >>> logits = head(hidden)[:, :-1].reshape(-1, 50)
        >>> full = torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1))
        >>> torch.allclose(chunked_causal_lm_loss(hidden, head, labels, chunk_size=4), full)
        True
    """
    weight, bias = _weight_and_bias(lm_head, bias)
    _check(hidden_states, weight, labels, chunk_size)
    targets = labels
    if shift:
        targets = functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = targets.reshape(-1).to(hidden_states.device)
    kept = targets.ne(ignore_index)
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    # dropped before lm_head: the positions without a target cost no matmul, and their gradient is zero
    weight, bias, shard = local_projection(weight, bias)  # under tensor parallelism: this rank's vocabulary
    total = _ChunkedLinearCrossEntropy.apply(
        flat[kept], weight, bias, targets[kept], chunk_size, softcap, shard
    )
    count = kept.sum() if num_items_in_batch is None else num_items_in_batch
    if isinstance(count, torch.Tensor):
        count = count.to(total.device)
    return total / count


def _weight_and_bias(
    lm_head: nn.Module | torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(lm_head, torch.Tensor):
        return lm_head, bias
    weight = getattr(lm_head, "weight", None)
    if not isinstance(lm_head, nn.Module) or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise TypeError(
            f"chunked_causal_lm_loss(lm_head={type(lm_head).__name__}) needs the output projection: an "
            "nn.Linear (model.lm_head) or its (vocab, hidden) weight tensor."
        )
    if bias is not None:
        raise TypeError("chunked_causal_lm_loss(bias=...) is for a weight tensor; the module's bias is used.")
    return weight, getattr(lm_head, "bias", None)


def _check(hidden_states: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int) -> None:
    if chunk_size < 1:
        raise ValueError(f"chunked_causal_lm_loss(chunk_size={chunk_size}) is invalid: it must be >= 1.")
    if weight.dim() != 2 or weight.shape[1] != hidden_states.shape[-1]:
        raise ValueError(
            f"chunked_causal_lm_loss: the lm_head weight has shape {tuple(weight.shape)}, but the hidden states "
            f"{tuple(hidden_states.shape)} need (vocab, {hidden_states.shape[-1]})."
        )
    if tuple(labels.shape) != tuple(hidden_states.shape[:-1]):
        raise ValueError(
            f"chunked_causal_lm_loss: labels of shape {tuple(labels.shape)} do not match hidden states of shape "
            f"{tuple(hidden_states.shape)}; they need {tuple(hidden_states.shape[:-1])}."
        )


def _logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's fp32 logits (the projection in the inputs' dtype, then upcast, as transformers does), and
    ``tanh(z / softcap)`` when capped (its backward needs it)."""
    logits = functional.linear(hidden, weight, bias).float()
    if softcap is None:
        return logits, None
    tanh = torch.tanh(logits.div_(softcap))
    return tanh * softcap, tanh


def _autocast_state(device_type: str) -> dict[str, Any]:
    """The forward's autocast setting, which backward (run outside autocast) restores for its recompute."""
    return {
        "device_type": device_type,
        "enabled": torch.is_autocast_enabled(device_type),
        "dtype": torch.get_autocast_dtype(device_type),
    }


def _log_sum_exp(logits: torch.Tensor, shard: VocabShard | None) -> torch.Tensor:
    """Each row's log-sum-exp over the whole vocabulary (over every rank's slice of it)."""
    if shard is None:
        return torch.logsumexp(logits, dim=-1)
    peak = logits.amax(dim=-1) if logits.shape[-1] else logits.new_full(logits.shape[:-1], -torch.inf)
    peak = all_reduce(peak, dist.ReduceOp.MAX, shard)
    summed = all_reduce((logits - peak[:, None]).exp_().sum(dim=-1), dist.ReduceOp.SUM, shard)
    return summed.log_() + peak


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``sum_i logsumexp(h_i W^T + b) - (h_i W^T + b)[t_i]`` over kept positions, one chunk at a time; with a
    vocabulary shard, ``W`` and ``b`` are this rank's rows and the sums run over every rank's."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        chunk_size: int,
        softcap: float | None,
        shard: VocabShard | None,
    ) -> torch.Tensor:
        columns, held = local_targets(targets, weight.shape[0], shard)
        log_sum_exp = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        picked = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            end = start + chunk_size
            logits, _ = _logits(hidden[start:end], weight, bias, softcap)
            log_sum_exp[start:end] = _log_sum_exp(logits, shard)
            if logits.shape[-1]:
                picked[start:end] = logits.gather(1, columns[start:end, None]).squeeze(1)
            del logits
        if held is not None:
            picked = all_reduce(picked.mul_(held), dist.ReduceOp.SUM, shard)
        ctx.save_for_backward(hidden, weight, bias, columns, held, log_sum_exp)
        ctx.chunk_size, ctx.softcap, ctx.shard = chunk_size, softcap, shard
        ctx.autocast = _autocast_state(hidden.device.type)
        return (log_sum_exp - picked).sum()

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, columns, held, log_sum_exp = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # summed over chunks in fp32 (the full path's single matmul rounds once, in the weight's dtype)
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        )
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_bias else None
        # backward runs outside autocast: the chunks are recomputed, and their gradients formed, under the
        # forward's setting (bf16 products under autocast), wherever backward is called
        with torch.autocast(**ctx.autocast):
            rows = torch.arange(min(ctx.chunk_size, hidden.shape[0]), device=hidden.device)
            for start in range(0, hidden.shape[0], ctx.chunk_size):
                end = start + ctx.chunk_size
                chunk = hidden[start:end]
                logits, tanh = _logits(chunk, weight, bias, ctx.softcap)
                # d/dz (logsumexp(z) - z[t]) = softmax(z) - onehot(t), in place on the chunk's logits
                grad = logits.sub_(log_sum_exp[start:end, None]).exp_()
                hit = 1.0 if held is None else held[start:end].to(grad.dtype)
                if grad.shape[-1]:
                    grad[rows[: chunk.shape[0]], columns[start:end]] -= hit
                grad.mul_(grad_total)
                if tanh is not None:
                    grad.mul_(1.0 - tanh * tanh)
                    del tanh
                grad = grad.to(weight.dtype)
                if grad_hidden is not None:
                    grad_hidden[start:end] = grad @ weight
                if grad_weight is not None and grad.dtype == torch.float32:
                    grad_weight.addmm_(grad.t(), chunk)
                elif grad_weight is not None:
                    grad_weight += (grad.t() @ chunk).float()
                if grad_bias is not None:
                    grad_bias += grad.sum(dim=0, dtype=torch.float32)
        if grad_hidden is not None:  # each rank's slice of the vocabulary adds its part
            all_reduce(grad_hidden, dist.ReduceOp.SUM, ctx.shard)
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None,
            None,
            None,
            None,
        )
