"""The step's cross-group half: gradients averaged over the replica groups of the quorum (the backend's step
hook then lets the step be applied only when every group commits).

Under FSDP2 inside a group each process holds a shard of every gradient (a ``DTensor``); rank ``r`` of
every group holds the same shard, so the shards are averaged as they are, rank ``r`` with rank ``r``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of ``tensor``: the local shard of a DTensor (the same storage), else itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def average_gradients(manager: Any, parameters: list[torch.Tensor]) -> None:
    """All-reduce one flat buffer of this process's gradients (a missing gradient counts as zeros) over the
    step's quorum, averaged, and copy it back."""
    for parameter in parameters:
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
    grads = [local(p.grad.detach()) for p in parameters]
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    manager.allreduce(flat).wait()
    offset = 0
    for grad in grads:
        size = grad.numel()
        grad.copy_(flat[offset : offset + size].view_as(grad))
        offset += size


def trained_parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters ``optimizer`` updates, in its (every group's identical) order."""
    return [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
