"""The router's load-balancing loss over the whole data-parallel batch, as one process computes it.

transformers computes the auxiliary loss (``load_balancing_loss_func``, Switch Transformer eq. 4-6) from the
fraction of tokens sent to each expert times the mean router probability per expert: a product of two means
over *all* tokens, so the mean of per-rank losses is not the one-process loss. Here the router logits (and
the attention mask) of every rank are gathered, in rank order, and the model's own function is applied to
them: each rank then holds the loss one process computes on the global batch.

Gradients: the gather is differentiable (its backward sums every rank's gradient into the owner's rows), and
every rank differentiates the same global loss, so each rank's router logits receive ``world_size`` times
their one-process gradient; averaging gradients over the ranks (as for every replicated parameter) divides it
back. The per-rank loss the model added (``router_aux_loss_coef * aux_loss``) is replaced by the global one;
its gradient cancels exactly (``+coef`` and ``-coef`` into the same node).

A training loop that multiplies each rank's loss by the number of replicas before its backward (transformers'
Trainer, and lockstep's, with ``num_items_in_batch`` summed over the processes: each rank's loss is then its
share of the job's summed loss) would multiply the global term, which every rank adds, by that number too.
Such a loop says so (:meth:`LossMultiplier.multiplied_by`, which the layer's :class:`GlobalLossTerm` capability
opens): each rank then adds ``coef * aux_loss / factor``, and the term counts once, as in one process.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any, final

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.utils.hooks import RemovableHandle

from lockstep.layers.expert_parallel._errors import ExpertParallelNotBuiltError


@final
class LossMultiplier:
    """The factor by which the training loop multiplies each rank's loss before its backward (1 by default).

    The global auxiliary loss is the same on every rank, and its gradient reaches every rank's router logits
    from every rank; a loop that multiplies each rank's loss by ``factor`` would count it ``factor`` times, so
    each rank adds ``coef * aux_loss / factor`` to the loss instead of ``coef * aux_loss``.
    """

    def __init__(self) -> None:
        self.factor = 1.0

    @contextlib.contextmanager
    def multiplied_by(self, factor: float) -> Iterator[None]:
        """The forwards inside return a loss that the loop multiplies by ``factor`` before its backward."""
        if not factor > 0:
            raise ValueError(f"LossMultiplier.multiplied_by({factor!r}) is invalid: the factor must be > 0.")
        previous, self.factor = self.factor, float(factor)
        try:
            yield
        finally:
            self.factor = previous


def gather_rows(rows: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's ``rows`` along dimension 0, in rank order; differentiable; uneven row counts."""
    count = torch.tensor([rows.shape[0]], device=rows.device)
    counts = [torch.empty_like(count) for _ in range(dist.get_world_size(group))]
    dist.all_gather(counts, count, group=group)
    sizes = [int(c) for c in counts]
    padded = torch.cat([rows, rows.new_zeros((max(sizes) - rows.shape[0], *rows.shape[1:]))])
    gathered = funcol.wait_tensor(funcol.all_gather_single(padded.contiguous(), 0, group))
    parts = torch.split(gathered, max(sizes))
    return torch.cat([part[:size] for part, size in zip(parts, sizes, strict=True)])


def global_load_balancing_loss(
    router_logits: tuple[torch.Tensor, ...],
    *,
    loss_function: Callable[..., Any],
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """``loss_function`` (the model's ``load_balancing_loss_func``) over every rank's router logits.

    Args:
        router_logits: this rank's logits, one ``(tokens, num_experts)`` tensor per MoE layer.
        loss_function: the model module's ``load_balancing_loss_func``.
        num_experts: experts per layer.
        top_k: experts chosen per token.
        attention_mask: this rank's mask (any shape whose flattening matches the tokens), or None.
        group: the data-parallel group whose ranks each route their own tokens.
    """
    widths = [layer.shape[-1] for layer in router_logits]
    gathered = gather_rows(torch.cat(router_logits, dim=-1), group)
    global_logits = tuple(torch.split(gathered, widths, dim=-1))
    global_mask = None
    if attention_mask is not None:
        global_mask = gather_rows(attention_mask.reshape(-1), group)
    return loss_function(global_logits, num_experts, top_k, global_mask)


def install_global_aux_loss(
    model: nn.Module, group: dist.ProcessGroup, multiplier: LossMultiplier | None = None
) -> RemovableHandle | None:
    """Make ``model``'s ``aux_loss`` (and the share of it in ``loss``) the one-process value over ``group``.

    ``multiplier``: the factor the loop multiplies each rank's loss by (the term added to ``loss`` is divided
    by it; ``aux_loss`` stays the global value); None for 1.

    A forward hook on the causal-LM module (no change to its forward). Returns None when ``model`` computes no
    auxiliary loss (no ``router_aux_loss_coef``): then the caller's own aux loss must use
    :func:`global_load_balancing_loss`.

    Raises:
        ExpertParallelNotBuiltError: the model has a ``router_aux_loss_coef`` but its module has no
            ``load_balancing_loss_func`` taking (logits, num_experts, top_k, attention_mask).
    """
    if not hasattr(model, "router_aux_loss_coef"):
        return None
    loss_function = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
    if loss_function is None:
        raise ExpertParallelNotBuiltError(
            f"{type(model).__name__} computes an auxiliary router loss (router_aux_loss_coef), but its module "
            f"{type(model).__module__} has no load_balancing_loss_func: lockstep cannot compute that loss "
            "over the whole batch for this model yet. Set output_router_logits=False, or router_aux_loss_coef=0."
        )
    signature = inspect.signature(model.forward)
    loss_multiplier = multiplier if multiplier is not None else LossMultiplier()

    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        bound = signature.bind_partial(*args, **kwargs).arguments
        if isinstance(output, tuple):
            _refuse_tuple_output(module, bound)
            return output
        router_logits = getattr(output, "router_logits", None)
        local_aux = getattr(output, "aux_loss", None)
        if not router_logits or local_aux is None:
            return output
        global_aux = global_load_balancing_loss(
            tuple(router_logits),
            loss_function=loss_function,
            num_experts=module.num_experts,
            top_k=module.num_experts_per_tok,
            attention_mask=bound.get("attention_mask"),
            group=group,
        )
        if output.loss is not None:
            coef = module.router_aux_loss_coef
            share = coef / loss_multiplier.factor
            output.loss = output.loss - coef * local_aux.to(output.loss.device) + share * global_aux
        output.aux_loss = global_aux
        return output

    return model.register_forward_hook(hook, with_kwargs=True)


def _refuse_tuple_output(model: nn.Module, arguments: dict[str, Any]) -> None:
    """A tuple output (``return_dict=False``) cannot be told apart field by field: refuse it if it holds an aux loss."""
    wants_router_logits = arguments.get("output_router_logits")
    if wants_router_logits is None:
        wants_router_logits = getattr(getattr(model, "config", None), "output_router_logits", False)
    if wants_router_logits:
        raise ExpertParallelNotBuiltError(
            f"{type(model).__name__}(..., return_dict=False) with output_router_logits under expert parallelism "
            "is not built: its per-rank auxiliary loss cannot be replaced by the global one in a tuple. Call the "
            "model with return_dict=True (the default)."
        )
