"""Gradient clipping over sharded gradients: the true global norm of all shards together."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lockstep.state import PartialState


def global_grad_norm(grads: list[torch.Tensor], norm_type: float, state: PartialState) -> torch.Tensor:
    """The norm of all gradients together: sharded (DTensor) parts are reduced over processes, replicated
    parts (ignored modules) are counted once."""
    device = grads[0].device if grads else state.device
    sharded = [g.to_local() for g in grads if isinstance(g, DTensor)]
    replicated = [g for g in grads if not isinstance(g, DTensor)]
    if math.isinf(norm_type):
        local = torch.zeros((), device=device, dtype=torch.float32)
        for grad in sharded + replicated:
            if grad.numel():
                local = torch.maximum(local, grad.detach().abs().max().float().to(device))
        if state.use_distributed and sharded:
            dist.all_reduce(local, op=dist.ReduceOp.MAX)
        return local
    shard_sum = torch.zeros((), device=device, dtype=torch.float32)
    for grad in sharded:
        shard_sum += torch.linalg.vector_norm(grad.detach().float(), norm_type).to(device) ** norm_type
    if state.use_distributed:
        dist.all_reduce(shard_sum)
    for grad in replicated:
        shard_sum += torch.linalg.vector_norm(grad.detach().float(), norm_type).to(device) ** norm_type
    return shard_sum ** (1.0 / norm_type)


def clip_sharded_gradients(
    parameters: list[torch.Tensor], max_norm: float, norm_type: float, state: PartialState
) -> torch.Tensor:
    """Scale every gradient (local shards in place) so that the global norm is at most ``max_norm``;
    returns the norm before clipping."""
    grads = [p.grad for p in parameters if p.grad is not None]
    total = global_grad_norm(grads, float(norm_type), state)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for grad in grads:
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            local.mul_(coefficient.to(device=local.device, dtype=local.dtype))
    return total
