"""``apply_expert_parallel``: shard a model's experts over an expert-parallel group, and the gradient step.

Gradient semantics (expert parallelism borrowed from data parallelism: each of the ``W`` data-parallel ranks
routes its own tokens, and the loss of each rank is the mean over its own tokens, as under DDP). The ranks form
ep groups of ``ep_size`` consecutive ranks, each holding every expert once; with ``ep_size < W`` each expert
shard is replicated over the ``W / ep_size`` ranks with the same rank in their ep group
(:mod:`lockstep.layers.expert_parallel._groups`):

* a dense (replicated) parameter's gradient on rank ``r`` is the gradient of rank ``r``'s loss; averaging it
  over the ``W`` ranks (all-reduce sum, divided by ``W``) gives the gradient of the global batch's loss;
* an expert parameter's all-to-all backward brings it the gradient of the losses of every rank of its ep group
  (the sum over those ranks' tokens); summing it over its replicas (all-reduce over the replica group) gives
  the sum over all ``W`` ranks, and dividing by ``W`` the same mean. The divisor is ``W``, not ``ep_size``.

:meth:`ExpertParallel.reduce_gradients` does both, after the last backward of a step and before clipping
and the optimizer step; then the result equals one process on the global batch. The clip's norm counts each
expert shard once: its part is summed over the ep group (every expert once), not over the replicas.
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
from lockstep.layers.expert_parallel._groups import (
    ExpertParallelGroups,
    check_ep_size,
    expert_parallel_groups,
)


@final
class ExpertParallel:
    """A model whose experts are sharded over an expert-parallel group; built by :func:`apply_expert_parallel`.

    Attributes:
        model: the model, changed in place.
        groups: this rank's process groups (ep group, replica group, data-parallel group).
        group: the expert-parallel process group (``groups.ep``): this rank's tokens are routed among its ranks,
            which hold every expert once between them.
        ep_size: the size of ``group``.
        ep_rank: this process's rank in ``group``.
        data_parallel_size: the ranks that each route their own tokens (``ep_size`` times the replicas); the
            gradients' divisor.
        experts: the swapped-in experts modules, by block name.
        loss_multiplier: the factor the training loop multiplies each rank's loss by (the global aux loss's
            share in the loss is divided by it); 1 unless a loop says otherwise
            (``ep.loss_multiplier.multiplied_by(n)``).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        groups: ExpertParallelGroups,
        experts: dict[str, ExpertParallelExperts],
        aux_loss_hook: RemovableHandle | None,
        loss_multiplier: LossMultiplier,
    ) -> None:
        """Hold what :func:`apply_expert_parallel` built; use that function to build one."""
        self.model = model
        self.groups = groups
        self.group = groups.ep
        self.ep_size = groups.ep_size
        self.ep_rank = groups.ep_rank
        self.data_parallel_size = groups.data_parallel_size
        self.experts = experts
        self._aux_loss_hook = aux_loss_hook
        self.loss_multiplier = loss_multiplier
        self._expert_params: list[nn.Parameter] = []
        self._dense_params: list[nn.Parameter] = []
        self.parameters_replaced()

    def parameters_replaced(self) -> None:
        """Read the model's parameters again, after something replaced them (FSDP2 sharding the experts)."""
        expert_ids = {id(p) for module in self.experts.values() for p in module.parameters()}
        self._expert_params = [p for p in self.model.parameters() if id(p) in expert_ids]
        self._dense_params = [p for p in self.model.parameters() if id(p) not in expert_ids]

    def expert_parameters(self) -> Iterator[nn.Parameter]:
        """This rank's expert parameters (its shard of every block's experts)."""
        return iter(self._expert_params)

    def dense_parameters(self) -> Iterator[nn.Parameter]:
        """The replicated parameters: everything but the experts."""
        return iter(self._dense_params)

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Average gradients over the data-parallel ranks so that they equal one process's on the global batch.

        Dense gradients: all-reduce sum over the data-parallel group (one flat bucket), then divide by its size,
        as DDP does. Expert gradients: :meth:`reduce_expert_gradients`. Call once per optimizer step, after the
        last backward (with gradient accumulation, after the last micro-batch), before clipping.

        Example:
            >>> loss.backward()  # doctest: +SKIP
            >>> ep.reduce_gradients()  # doctest: +SKIP
            >>> ep.clip_grad_norm_(1.0)  # doctest: +SKIP
            >>> optimizer.step()  # doctest: +SKIP
        """
        dense = [p.grad for p in self._dense_params if p.grad is not None]
        _all_reduce_flat(dense, self.groups.data_parallel)
        for grad in dense:
            grad.div_(self.data_parallel_size)
        self.reduce_expert_gradients()

    @torch.no_grad()
    def reduce_expert_gradients(self) -> None:
        """Make the expert gradients one process's on the global batch, once per optimizer step: sum them over
        the replicas of this rank's experts (the all-to-all's backward summed the tokens of this rank's ep group
        into them; the replicas hold the other groups' sums), then divide by the data-parallel size (dense
        gradients get theirs from the all-reduce: :meth:`reduce_gradients`, or DDP under the Accelerator).
        After a backward every replica holds a gradient of each of its expert parameters (a shard that received
        no token gets zeros: :class:`ExpertParallelExperts`), so the replicas sum the same tensors."""
        self._sum_over_replicas()
        for param in self._expert_params:
            if param.grad is not None:
                param.grad.div_(self.data_parallel_size)

    def _sum_over_replicas(self) -> None:
        if self.groups.replicas is not None:
            _all_reduce_flat(
                [p.grad for p in self._expert_params if p.grad is not None], self.groups.replicas
            )

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, parameters: Iterable[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Clip every gradient by the norm of the whole model's gradient, as one process would; return it.

        Dense gradients are the same on every rank (after :meth:`reduce_gradients`); expert gradients are
        sharded, so their part of the norm is reduced over the ep group (each expert once: its replicas hold
        the same gradient and are not counted again). ``norm_type`` is 2 or ``inf``.
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
def _all_reduce_flat(grads: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Sum ``grads`` over ``group`` in place, as one flat bucket (one collective)."""
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()


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
    reduced over ``group``, the ep group (every expert once; replicas of a shard hold the same gradient and
    count once); the others are replicated (their gradients equal on every rank) and count once.
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
    model: nn.Module,
    group: dist.ProcessGroup | DeviceMesh | ExpertParallelGroups | None = None,
    *,
    ep_size: int | None = None,
) -> ExpertParallel:
    """Shard every recognised MoE block's experts of ``model`` over ep groups of ``ep_size`` ranks, in place.

    Each rank keeps ``num_experts / ep_size`` experts per block and routes its own tokens to the ranks of its
    ep group holding their experts (all-to-all), and the model's auxiliary router loss becomes the one over
    every data-parallel rank's tokens. Expert parallelism is borrowed from data parallelism: every rank of
    ``group`` feeds its own batch, and :meth:`ExpertParallel.reduce_gradients` replaces DDP's gradient
    averaging (do not wrap the model in DDP). With ``ep_size`` smaller than the group, the ranks form ep groups
    of ``ep_size`` consecutive ranks and each expert shard is replicated over the ``size / ep_size`` ranks with
    the same rank in their group (:mod:`lockstep.layers.expert_parallel._groups`); the shards are broadcast
    from the first of them, as DDP broadcasts the dense weights from rank 0. Every check runs before the first
    collective.

    Args:
        model: a model holding recognised sparse-MoE blocks (see :func:`recognised_blocks`), every rank built
            from the same weights.
        group: the data-parallel group: a process group or a 1-D device mesh; None for the whole world. Or
            the :class:`ExpertParallelGroups` an earlier call built (to shard another model over the same
            groups without creating them again).
        ep_size: the ranks each expert is sharded over; None for the whole ``group``. It must divide the
            group's size; smaller than it, the group must be the world.

    Raises:
        MoEModelNotSupportedError: no recognised MoE block in ``model``.
        ExpertShardingError: a block's ``num_experts`` is not divisible by ``ep_size``, or ``ep_size`` does
            not divide the group's size.
        ExpertParallelNotBuiltError: the model is already distributed (DTensor parameters, DDP), a mesh of
            more than one dimension is passed, or ``ep_size`` is smaller than a group other than the world.

    Example:
        >>> ep = apply_expert_parallel(model, ep_size=2)  # doctest: +SKIP
        >>> loss = model(input_ids=ids, labels=ids).loss  # doctest: +SKIP
        >>> loss.backward(); ep.reduce_gradients(); ep.clip_grad_norm_(1.0)  # doctest: +SKIP
    """
    blocks = find_moe_blocks(model)
    _refuse_unbuilt(model, group)
    if isinstance(group, ExpertParallelGroups):
        if ep_size is not None and ep_size != group.ep_size:
            raise ValueError(
                f"apply_expert_parallel(group=<ExpertParallelGroups of ep_size {group.ep_size}>, "
                f"ep_size={ep_size}) is contradictory: the groups fix the ep size. Drop ep_size."
            )
        check_divisible(blocks, group.ep_size)
        groups = group
    else:
        data_parallel = _process_group(group)
        size = dist.get_world_size(data_parallel) if ep_size is None else ep_size
        check_ep_size(size, dist.get_world_size(data_parallel))
        check_divisible(blocks, size)
        groups = expert_parallel_groups(size, data_parallel)  # the first collective (with replicas)
    experts = {}
    for block in blocks:
        sharded = ExpertParallelExperts(
            block.experts, group=groups.ep, ep_rank=groups.ep_rank, ep_size=groups.ep_size
        )
        setattr(block.block, block.experts_attribute, sharded)
        experts[block.name] = sharded
    _broadcast_from_first_replica(experts.values(), groups)
    multiplier = LossMultiplier()
    hook = install_global_aux_loss(model, groups.data_parallel, multiplier)
    return ExpertParallel(
        model, groups=groups, experts=experts, aux_loss_hook=hook, loss_multiplier=multiplier
    )


@torch.no_grad()
def _broadcast_from_first_replica(
    experts: Iterable[ExpertParallelExperts], groups: ExpertParallelGroups
) -> None:
    """Make every replica of a shard hold the first replica's weights (DDP does the same for the dense ones)."""
    if groups.replicas is None:
        return
    source = dist.get_global_rank(groups.replicas, 0)
    for module in experts:
        for param in module.parameters(recurse=False):
            dist.broadcast(param.data, src=source, group=groups.replicas)


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


def check_divisible(blocks: list[MoEBlock], ep_size: int) -> None:
    """Raise :class:`ExpertShardingError` unless ``ep_size`` divides every block's experts (no collective)."""
    for block in blocks:
        if block.num_experts % ep_size:
            raise ExpertShardingError(
                f"expert parallelism over {ep_size} ranks cannot split the {block.num_experts} experts of "
                f"{block.name!r} ({type(block.block).__name__}): num_experts % ep_size must be 0. Use an "
                f"ep_size that divides {block.num_experts}."
            )


def _refuse_unbuilt(
    model: nn.Module, group: dist.ProcessGroup | DeviceMesh | ExpertParallelGroups | None
) -> None:
    from torch.distributed.tensor import DTensor

    later = "lockstep builds that next (see lockstep.layers.expert_parallel)"
    if isinstance(group, DeviceMesh) and group.ndim != 1:
        raise ExpertParallelNotBuiltError(
            f"apply_expert_parallel(group=<{group.ndim}-D DeviceMesh>) is not built: pass the 1-D 'ep' mesh. "
            "With FSDP2, use the Accelerator with ParallelismConfig(dp_shard_size=..., ep_size=...); expert "
            f"parallelism composed with TP or HSDP is not built yet; {later}."
        )
    # A wrapper (DDP, a DeepSpeed engine, FSDP1) holds the model as ``.module``; FSDP2 and TP leave DTensors.
    wrapped = isinstance(getattr(model, "module", None), nn.Module)
    if wrapped or any(isinstance(p, DTensor) for p in model.parameters()):
        raise ExpertParallelNotBuiltError(
            f"apply_expert_parallel() was given a model that is already distributed "
            f"({type(model).__name__}: a wrapper such as DDP, or FSDP2/TP parameters): composing expert parallelism with "
            f"them is not built yet; {later}. Apply it to the plain model and do not wrap it in DDP."
        )
