"""Gradient clipping over sharded gradients: the true global norm of all shards together.

A gradient may be a DTensor on any mesh: sharded by FSDP over ``dp_shard``, split by tensor parallelism
over ``tp``, or both (a 2-D mesh). Each local part counts once: the local sums are reduced over exactly
the mesh dimensions the tensor is sharded on, never over the dimensions it is replicated on (a
replicated copy counted ``tp`` times would inflate the norm).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import Partial

from lockstep.state import PartialState

_Key = tuple[int, tuple[int, ...]]


def _local_part(grad: DTensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This rank's part of ``grad`` and the mesh dimensions it is sharded over (partial sums replicated first)."""
    if any(isinstance(p, Partial) for p in grad.placements):
        grad = grad.redistribute(
            grad.device_mesh, [Replicate() if isinstance(p, Partial) else p for p in grad.placements]
        )
    # Not p.is_shard(): FSDP over a tensor-parallel split makes a _StridedShard, which is no Shard but splits too
    sharded = tuple(dim for dim, p in enumerate(grad.placements) if not p.is_replicate())
    return grad.to_local(), sharded


def _reduce(value: torch.Tensor, mesh: DeviceMesh, dims: tuple[int, ...], op: dist.ReduceOp) -> None:
    # Reducing over each sharded dimension in turn reduces over their product.
    for dim in dims:
        dist.all_reduce(value, op=op, group=mesh.get_group(dim))


def global_grad_norm(grads: list[torch.Tensor], norm_type: float, state: PartialState) -> torch.Tensor:
    """The norm of all gradients together: each DTensor's local parts reduced over the mesh dimensions it is
    sharded on; plain (replicated) gradients counted once."""
    device = grads[0].device if grads else state.device
    infinite = math.isinf(norm_type)
    op = dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM
    meshes: dict[int, DeviceMesh] = {}
    parts: dict[_Key, torch.Tensor] = {}  # in parameter order: every rank reduces in the same order
    plain = torch.zeros((), device=device, dtype=torch.float32)

    def local_value(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.detach().float()
        if infinite:
            return grad.abs().max().to(device) if grad.numel() else torch.zeros((), device=device)
        return torch.linalg.vector_norm(grad, norm_type).to(device) ** norm_type

    def combine(total: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return torch.maximum(total, value) if infinite else total + value

    for grad in grads:
        if isinstance(grad, DTensor):
            local, dims = _local_part(grad)
            key = (id(grad.device_mesh), dims)
            meshes[key[0]] = grad.device_mesh
            parts[key] = combine(parts.get(key, torch.zeros((), device=device)), local_value(local))
        else:
            plain = combine(plain, local_value(grad))
    total = plain
    for (mesh_id, dims), value in parts.items():
        if state.use_distributed and dims:
            _reduce(value, meshes[mesh_id], dims, op)
        total = combine(total, value)
    return total if infinite else total ** (1.0 / norm_type)


def clip_sharded_gradients(
    parameters: list[torch.Tensor], max_norm: float, norm_type: float, state: PartialState
) -> torch.Tensor:
    """Scale every gradient (local shards in place) so that the global norm is at most ``max_norm``;
    returns the norm before clipping."""
    grads = [p.grad for p in parameters if p.grad is not None]
    total = global_grad_norm(grads, float(norm_type), state)
    scale_to_max_norm(grads, total, max_norm)
    return total


def scale_to_max_norm(grads: list[torch.Tensor], total: torch.Tensor, max_norm: float) -> None:
    """Scale ``grads`` (each local part, in place) by ``max_norm / total`` when ``total``, their global norm,
    is above ``max_norm``; leave them as they are otherwise."""
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for grad in grads:
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            local.mul_(coefficient.to(device=local.device, dtype=local.dtype))
