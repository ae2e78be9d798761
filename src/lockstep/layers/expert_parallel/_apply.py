"""``apply_expert_parallel``: shard a model's experts over an expert-parallel group, and the gradient step.

Gradient semantics (expert parallelism borrowed from data parallelism: each rank routes its own tokens, and
the loss of each rank is the mean over its own tokens, as under DDP):

* a dense (replicated) parameter's gradient on rank ``r`` is the gradient of rank ``r``'s loss; averaging it
  over the ``W`` ranks (all-reduce sum, divided by ``W``) gives the gradient of the global batch's loss;
* an expert parameter exists on one rank only, and the all-to-all's backward already brings it the gradient of
  *every* rank's loss: the sum over the ranks. Dividing it by ``W`` gives the same mean.

:meth:`ExpertParallel.reduce_gradients` does both, after the last backward of a step and before clipping
and the optimizer step; then the result equals one process on the global batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import final

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.hooks import RemovableHandle

from lockstep.layers.expert_parallel._aux_loss import LossMultiplier, install_global_aux_loss
from lockstep.layers.expert_parallel._blocks import MoEBlock, find_moe_blocks
from lockstep.layers.expert_parallel._dispatch import ExpertParallelExperts
from lockstep.layers.expert_parallel._errors import ExpertParallelNotBuiltError, ExpertShardingError


@final
class ExpertParallel:
    """A model whose experts are sharded over an expert-parallel group; built by :func:`apply_expert_parallel`.

    Attributes:
        model: the model, changed in place.
        group: the expert-parallel process group (also the data-parallel group: ep is borrowed from it).
        ep_size: the size of ``group``.
        ep_rank: this process's rank in ``group``.
        experts: the swapped-in experts modules, by block name.
        loss_multiplier: the factor the training loop multiplies each rank's loss by (the global aux loss's
            share in the loss is divided by it); 1 unless a loop says otherwise
            (``ep.loss_multiplier.multiplied_by(n)``).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        group: dist.ProcessGroup,
        experts: dict[str, ExpertParallelExperts],
        aux_loss_hook: RemovableHandle | None,
        loss_multiplier: LossMultiplier,
    ) -> None:
        """Hold what :func:`apply_expert_parallel` built; use that function to build one."""
        self.model = model
        self.group = group
        self.ep_size = dist.get_world_size(group)
        self.ep_rank = dist.get_rank(group)
        self.experts = experts
        self._aux_loss_hook = aux_loss_hook
        self.loss_multiplier = loss_multiplier
        expert_ids = {id(p) for module in experts.values() for p in module.parameters()}
        self._expert_params = [p for p in model.parameters() if id(p) in expert_ids]
        self._dense_params = [p for p in model.parameters() if id(p) not in expert_ids]

    def expert_parameters(self) -> Iterator[nn.Parameter]:
        """This rank's expert parameters (its shard of every block's experts)."""
        return iter(self._expert_params)

    def dense_parameters(self) -> Iterator[nn.Parameter]:
        """The replicated parameters: everything but the experts."""
        return iter(self._dense_params)

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Average gradients over the group so that they equal one process's on the global batch.

        Dense gradients: all-reduce sum (one flat bucket), then divide by the group size, as DDP does. Expert
        gradients: divide by the group size only (the all-to-all backward already summed every rank's tokens
        into them). Call once per optimizer step, after the last backward (with gradient accumulation, after
        the last micro-batch), before clipping.

        Example:
            >>> loss.backward()  # doctest: +SKIP
            >>> ep.reduce_gradients()  # doctest: +SKIP
            >>> ep.clip_grad_norm_(1.0)  # doctest: +SKIP
            >>> optimizer.step()  # doctest: +SKIP
        """
        dense = [p.grad for p in self._dense_params if p.grad is not None]
        if dense:
            flat = torch.cat([g.reshape(-1) for g in dense])
            dist.all_reduce(flat, group=self.group)
            flat.div_(self.ep_size)
            offset = 0
            for grad in dense:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()
        self.scale_expert_gradients()

    @torch.no_grad()
    def scale_expert_gradients(self) -> None:
        """Divide the expert gradients by the group size, once per optimizer step: the all-to-all's backward
        summed every rank's tokens into them, and the mean is what one process on the global batch has (dense
        gradients get theirs from the all-reduce: :meth:`reduce_gradients`, or DDP under the Accelerator)."""
        for param in self._expert_params:
            if param.grad is not None:
                param.grad.div_(self.ep_size)

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, parameters: Iterable[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Clip every gradient by the norm of the whole model's gradient, as one process would; return it.

        Dense gradients are the same on every rank (after :meth:`reduce_gradients`); expert gradients are
        sharded, so their part of the norm is reduced over the group. ``norm_type`` is 2 or ``inf``.
        ``parameters``: the ones to clip (all of the model's by default); every rank passes the same ones.
        """
        expert_ids = {id(p) for p in self._expert_params}
        given = self.model.parameters() if parameters is None else parameters
        return clip_by_global_norm(given, expert_ids, max_norm, norm_type, self.group)

    def remove_aux_loss_hook(self) -> None:
        """Stop replacing the model's auxiliary loss by the global one."""
        if self._aux_loss_hook is not None:
            self._aux_loss_hook.remove()
            self._aux_loss_hook = None


@torch.no_grad()
def clip_by_global_norm(
    parameters: Iterable[torch.Tensor],
    expert_ids: set[int],
    max_norm: float,
    norm_type: float,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """Clip ``parameters``' gradients by their norm over the whole model, as one process computes it; return it.

    A parameter whose ``id`` is in ``expert_ids`` is this rank's shard of experts: its part of the norm is
    reduced over ``group``; the others are replicated (their gradients equal on every rank) and count once.
    """
    if norm_type not in (2.0, math.inf):
        raise ValueError(
            f"clip_grad_norm_(norm_type={norm_type!r}) with expert parallelism is not supported: pass 2.0 or "
            "math.inf."
        )
    grads = [(id(p) in expert_ids, p.grad) for p in parameters if p.grad is not None]
    dense = [grad for is_expert, grad in grads if not is_expert]
    expert = [grad for is_expert, grad in grads if is_expert]
    total = _norm(dense, expert, norm_type, group)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for _, grad in grads:
        grad.mul_(coef.to(grad.dtype))
    return total


def _norm(
    dense: list[torch.Tensor], expert: list[torch.Tensor], norm_type: float, group: dist.ProcessGroup
) -> torch.Tensor:
    zero = torch.zeros((), dtype=torch.float32)
    if norm_type == math.inf:
        dense_part = max((g.abs().max().float() for g in dense), default=zero)
        expert_part = max((g.abs().max().float() for g in expert), default=zero).clone()
        dist.all_reduce(expert_part, op=dist.ReduceOp.MAX, group=group)
        return torch.maximum(dense_part, expert_part)
    dense_sq = sum((g.float().pow(2).sum() for g in dense), zero)
    expert_sq = sum((g.float().pow(2).sum() for g in expert), zero).clone()
    dist.all_reduce(expert_sq, group=group)
    return (dense_sq + expert_sq).sqrt()


def apply_expert_parallel(
    model: nn.Module, group: dist.ProcessGroup | DeviceMesh | None = None
) -> ExpertParallel:
    """Shard every recognised MoE block's experts of ``model`` over ``group``, in place.

    Each rank keeps ``num_experts / ep_size`` experts per block and routes its own tokens to the ranks holding
    their experts (all-to-all), and the model's auxiliary router loss becomes the one over every rank's tokens.
    Expert parallelism is borrowed from data parallelism: every rank of ``group`` feeds its own batch, and
    :meth:`ExpertParallel.reduce_gradients` replaces DDP's gradient averaging (do not wrap the model in DDP).
    Every check runs before the first collective.

    Args:
        model: a model holding recognised sparse-MoE blocks (see :func:`recognised_blocks`), every rank built
            from the same weights.
        group: the expert-parallel group: a process group or a 1-D device mesh; None for the whole world.

    Raises:
        MoEModelNotSupportedError: no recognised MoE block in ``model``.
        ExpertShardingError: a block's ``num_experts`` is not divisible by the group's size.
        ExpertParallelNotBuiltError: the model is already distributed (DTensor parameters, DDP), or a mesh of
            more than one dimension is passed.

    Example:
        >>> ep = apply_expert_parallel(model)  # doctest: +SKIP
        >>> loss = model(input_ids=ids, labels=ids).loss  # doctest: +SKIP
        >>> loss.backward(); ep.reduce_gradients(); ep.clip_grad_norm_(1.0)  # doctest: +SKIP
    """
    blocks = find_moe_blocks(model)
    _refuse_unbuilt(model, group)
    process_group = _process_group(group)
    ep_size, ep_rank = dist.get_world_size(process_group), dist.get_rank(process_group)
    _check_divisible(blocks, ep_size)
    experts = {}
    for block in blocks:
        sharded = ExpertParallelExperts(block.experts, group=process_group, ep_rank=ep_rank, ep_size=ep_size)
        setattr(block.block, block.experts_attribute, sharded)
        experts[block.name] = sharded
    multiplier = LossMultiplier()
    hook = install_global_aux_loss(model, process_group, multiplier)
    return ExpertParallel(
        model, group=process_group, experts=experts, aux_loss_hook=hook, loss_multiplier=multiplier
    )


def _process_group(group: dist.ProcessGroup | DeviceMesh | None) -> dist.ProcessGroup:
    if isinstance(group, DeviceMesh):
        return group.get_group()
    if group is None:
        if not dist.is_initialized():
            raise RuntimeError(
                "apply_expert_parallel(model) needs an initialized process group: call "
                "torch.distributed.init_process_group() (or create the Accelerator) first, or pass group=."
            )
        return dist.group.WORLD
    return group


def _check_divisible(blocks: list[MoEBlock], ep_size: int) -> None:
    for block in blocks:
        if block.num_experts % ep_size:
            raise ExpertShardingError(
                f"expert parallelism over {ep_size} ranks cannot split the {block.num_experts} experts of "
                f"{block.name!r} ({type(block.block).__name__}): num_experts % ep_size must be 0. Use an "
                f"ep_size that divides {block.num_experts}."
            )


def _refuse_unbuilt(model: nn.Module, group: dist.ProcessGroup | DeviceMesh | None) -> None:
    from torch.distributed.tensor import DTensor

    later = "lockstep builds that next (see lockstep.layers.expert_parallel)"
    if isinstance(group, DeviceMesh) and group.ndim != 1:
        raise ExpertParallelNotBuiltError(
            f"apply_expert_parallel(group=<{group.ndim}-D DeviceMesh>) is not built: pass the 1-D 'ep' mesh. "
            f"Expert parallelism composed with FSDP2, TP or HSDP (ParallelismConfig(ep_size=...)) is not "
            f"built yet; {later}."
        )
    # A wrapper (DDP, a DeepSpeed engine, FSDP1) holds the model as ``.module``; FSDP2 and TP leave DTensors.
    wrapped = isinstance(getattr(model, "module", None), nn.Module)
    if wrapped or any(isinstance(p, DTensor) for p in model.parameters()):
        raise ExpertParallelNotBuiltError(
            f"apply_expert_parallel() was given a model that is already distributed "
            f"({type(model).__name__}: a wrapper such as DDP, or FSDP2/TP parameters): composing expert parallelism with "
            f"them is not built yet; {later}. Apply it to the plain model and do not wrap it in DDP."
        )
