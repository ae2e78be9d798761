"""Expert parallelism composed with FSDP2 (``ParallelismConfig(dp_shard_size=N, ep_size=E)``), torchtitan's way.

The ``N`` data-parallel ranks form ep groups of ``E`` consecutive ranks, as under DDP
(:mod:`lockstep.layers.expert_parallel._groups`); each routes its own tokens. Then:

* each experts module (this rank's ``num_experts / E`` experts of a block) is sharded by FSDP2 over its replica
  group, the ``N / E`` ranks that hold the same experts (torchtitan's ``dp_shard_mod_ep``; one rank when
  ``E == N``), before the backend shards the model (:class:`~lockstep.backends.capabilities.SeparateSharding`);
* the backend then shards the dense weights over all ``N`` ranks (``fully_shard`` skips the experts modules,
  sharded already);
* FSDP2 reduce-scatters an expert gradient (the sum over its ep group's tokens, from the all-to-all's backward)
  over the replica group and divides it by ``N``, not by the group's size (``set_gradient_divide_factor``): the
  sum over every rank's tokens divided by ``N``, as the dense gradients are averaged over the ``N`` ranks;
  FSDP2's ``set_requires_gradient_sync`` (``no_sync`` of accumulation) covers the experts modules too;
* the clip's norm: every element of every gradient is held by exactly one rank (dense shards over the ``N``
  ranks, expert shards over their replicas, the ep groups holding different experts), so the sum of the local
  squares over the world is the one-process norm (:func:`clip_fully_sharded`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lockstep.backends.capabilities import SeparateSharding
from lockstep.layers.expert_parallel._apply import ExpertParallel, _norm
from lockstep.layers.expert_parallel._groups import ExpertParallelGroups


def replica_mesh(groups: ExpertParallelGroups, device_type: str) -> DeviceMesh:
    """The 1-D mesh of the ranks holding this rank's experts (this rank alone when ``ep`` is every rank)."""
    group = groups.replicas
    if group is None:
        # Only this rank takes part, so no other rank has to call new_group at the same time.
        group = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    return DeviceMesh.from_group(group, device_type)


def shard_experts_apart(
    parallel: ExpertParallel,
    full: dict[str, nn.Parameter],
    *,
    sharding: SeparateSharding,
    mesh: DeviceMesh,
) -> None:
    """``fully_shard`` every experts module of ``parallel`` over ``mesh`` (its replica group), with the gradient
    divided by the data-parallel size.

    Args:
        parallel: the model with its experts sharded over ep groups.
        full: the model's parameters before :func:`apply_expert_parallel`, by name: an optimizer built before
            ``prepare`` holds these full expert tensors, re-bound to the sharded ones.
        sharding: the backend's capability.
        mesh: the replica group's mesh.
    """
    modules = {id(module): module for module in parallel.experts.values()}
    for path, module in parallel.model.named_modules():
        if id(module) not in modules:
            continue
        names = [name for name, _ in module.named_parameters(recurse=False)]
        sharding.shard_apart(module, mesh, replaced={name: full[f"{path}.{name}"] for name in names})
        module.set_gradient_divide_factor(float(parallel.data_parallel_size))  # type: ignore[operator]
        module.parameters_replaced()
    parallel.parameters_replaced()


def divide_once_on_one_rank(parallel: ExpertParallel, mesh: DeviceMesh) -> None:
    """After the backend sharded the model: on a replica group of one rank (``ep_size`` equal to the
    data-parallel size), let FSDP2 divide the experts' gradients by the data-parallel size once.

    On gloo the backend forces plain-sum reductions (``set_force_sum_reduction_for_comms``, gloo has no
    ``PREMUL_SUM``); torch 2.13's FSDP2 then divides a one-rank group's gradients by a custom divide factor
    twice (once in place of the reduce-scatter, once after it: ``foreach_reduce``). Nothing is communicated on
    one rank, so the forced sums are switched off again for these modules.
    """
    if mesh.size() != 1:
        return
    for module in parallel.experts.values():
        module.set_force_sum_reduction_for_comms(False)  # type: ignore[operator]


@torch.no_grad()
def clip_fully_sharded(
    parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float, group: dist.ProcessGroup
) -> torch.Tensor:
    """Clip ``parameters``' gradients by their norm over the whole model, as one process; return the norm.

    Each DTensor gradient is sharded (FSDP2's ``Shard(0)``) and every element is held by exactly one rank of
    ``group`` (the data-parallel ranks: dense weights sharded over all of them, experts over their replicas
    within distinct ep groups), so its local part's share of the norm is reduced over ``group``; a plain
    gradient (a parameter left out of FSDP2) is replicated and counts once.
    """
    if norm_type not in (2.0, math.inf):
        raise ValueError(
            f"clip_grad_norm_(norm_type={norm_type!r}) with expert parallelism is not supported: pass 2.0 or "
            "math.inf."
        )
    grads = [p.grad for p in parameters if p.grad is not None]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    sharded = [_local_shard(g) for g in grads if isinstance(g, DTensor)]
    total = _norm(plain, sharded, norm_type, group)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in [*plain, *sharded]:
        grad.mul_(coef.to(grad.dtype))
    return total


def _local_shard(grad: Any) -> torch.Tensor:
    if not all(placement.is_shard() for placement in grad.placements):
        raise AssertionError(  # an invariant of the dp_shard-only layout that ParallelismConfig allows
            f"expert parallelism with FSDP2 expects gradients sharded on every mesh dimension, got "
            f"{grad.placements} on {grad.device_mesh}"
        )
    return grad.to_local()
