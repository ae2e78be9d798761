"""The step's cross-group half: gradients averaged over the replica groups of the quorum, and an optimizer
that steps only when every group commits.

Under FSDP2 inside a group each process holds a shard of every gradient (a ``DTensor``); rank ``r`` of
every group holds the same shard, so the shards are averaged as they are, rank ``r`` with rank ``r``.
"""

from __future__ import annotations

from collections.abc import Callable
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


class QuorumOptimizer(torch.optim.Optimizer):
    """The user's optimizer, stepped only when the step's quorum commits (its state is the user's)."""

    def __init__(self, optimizer: torch.optim.Optimizer, synchronize: Callable[[list[torch.Tensor]], bool]):
        # No Optimizer.__init__: state and param_groups stay the wrapped optimizer's own objects.
        self.optimizer = optimizer
        self._synchronize = synchronize
        self.committed: bool | None = None
        """Whether the last step committed (None before the first)."""

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        if closure is not None:
            raise ValueError(
                "Accelerator(fault_tolerance=...) cannot step with a closure (one quorum per step)."
            )
        self.committed = self._synchronize(self.trained_parameters())
        return self.optimizer.step() if self.committed else None

    def trained_parameters(self) -> list[torch.Tensor]:
        """The parameters this optimizer updates, in its (every group's identical) order."""
        return [p for group in self.optimizer.param_groups for p in group["params"] if p.requires_grad]

    def __repr__(self) -> str:
        return f"FaultTolerant({self.optimizer!r})"
