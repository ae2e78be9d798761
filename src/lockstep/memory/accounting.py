"""How many bytes this rank really holds in parameters, gradients and optimizer state.

:func:`account_memory` walks a (prepared) model and its optimizers and adds up the bytes of every distinct
tensor *storage* it finds, so that views, tied weights and gradients that are views into DDP's buckets are
counted once. Sharded parameters (FSDP2 / DTensor) count their local shard only, which is what this rank
holds. The process's peak resident memory (and the peak accelerator memory, when there is one) comes along,
so a measured run can be set against the estimates of ``lockstep estimate-memory``.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(10, 10)
    >>> optimizer = torch.optim.AdamW(model.parameters())
    >>> model(torch.randn(2, 10)).sum().backward(); optimizer.step()
    >>> account = account_memory(model, optimizer)
    >>> account.parameter_bytes, account.gradient_bytes
    (440, 440)
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class MemoryAccount:
    """Bytes held by one rank, by category (each storage counted once, in the first category that holds it).

    Attributes:
        num_parameters: elements of the parameters held by this rank (local shards for sharded ones).
        parameter_bytes: bytes of the parameter storages.
        gradient_bytes: bytes of the gradient storages (0 before the first backward or after
            ``zero_grad(set_to_none=True)``).
        optimizer_state_bytes: bytes of the tensors in the optimizers' ``state`` (Adam's moments, steps...).
        peak_rss_bytes: the process's peak resident set size so far (``getrusage``), all memory included.
        peak_device_bytes: peak memory allocated by torch on the current accelerator, None without one.
    """

    num_parameters: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    peak_rss_bytes: int
    peak_device_bytes: int | None = None

    @property
    def model_state_bytes(self) -> int:
        """Parameters + gradients + optimizer state: what ``estimate-memory`` predicts as model state."""
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_state_bytes

    def as_dict(self) -> dict[str, int | None]:
        """A plain dict (JSON-ready), with ``model_state_bytes`` added."""
        return {**asdict(self), "model_state_bytes": self.model_state_bytes}


def account_memory(
    model: nn.Module, optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] = ()
) -> MemoryAccount:
    """Count the bytes held by ``model``'s parameters and gradients and by ``optimizers``' state on this rank.

    Args:
        model: the model, prepared or not (DDP / FSDP wrappers are fine: their parameters are walked).
        optimizers: one optimizer (prepared or not) or several; their ``state`` tensors are counted.

    Returns:
        A :class:`MemoryAccount` for this rank.

    Example:
        >>> account_memory(torch.nn.Linear(4, 2)).parameter_bytes
        40
    """
    return _account(list(model.parameters()), _optimizer_state_tensors(_optimizer_list(optimizers)))


def account_parameters(
    parameters: Iterable[torch.Tensor],
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] = (),
) -> MemoryAccount:
    """:func:`account_memory` of some parameters only: their storages, their gradients, and the optimizers'
    state kept for them (not for the others), so that a model's parts can be counted apart.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> account_parameters([model.bias]).parameter_bytes
        8
    """
    parameters = list(parameters)
    wanted = {id(p) for p in parameters}
    states = (
        value
        for optimizer in _optimizer_list(optimizers)
        for param, per_parameter in _inner(optimizer).state.items()
        if id(param) in wanted
        for value in per_parameter.values()
        if isinstance(value, torch.Tensor)
    )
    return _account(parameters, states)


def _optimizer_list(
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
) -> list[torch.optim.Optimizer]:
    return [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)


def _inner(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer wraps the user's


def _account(parameters: list[torch.Tensor], optimizer_states: Iterable[torch.Tensor]) -> MemoryAccount:
    seen: set[tuple[str, int]] = set()
    parameter_bytes = _bytes_of(parameters, seen)
    gradient_bytes = _bytes_of((p.grad for p in parameters if p.grad is not None), seen)
    optimizer_bytes = _bytes_of(optimizer_states, seen)
    return MemoryAccount(
        num_parameters=sum(_local(p).numel() for p in parameters),
        parameter_bytes=parameter_bytes,
        gradient_bytes=gradient_bytes,
        optimizer_state_bytes=optimizer_bytes,
        peak_rss_bytes=peak_rss_bytes(),
        peak_device_bytes=_peak_device_bytes(),
    )


def peak_rss_bytes() -> int:
    """The peak resident set size of this process, in bytes (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _peak_device_bytes() -> int | None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated()
    return None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank holds: a DTensor's local shard, else the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    if callable(to_local):
        return to_local()
    return tensor


def _bytes_of(tensors: Iterable[torch.Tensor], seen: set[tuple[str, int]]) -> int:
    """Bytes of the storages behind ``tensors`` not already in ``seen`` (which is updated)."""
    total = 0
    for tensor in tensors:
        local = _local(tensor)
        if local.device.type == "meta":
            continue
        storage = local.untyped_storage()
        key = (str(local.device), storage.data_ptr())
        if storage.data_ptr() == 0 or key in seen:  # empty tensors have no storage to count
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def _optimizer_state_tensors(optimizers: Iterable[torch.optim.Optimizer]) -> Iterator[torch.Tensor]:
    for optimizer in optimizers:
        for per_parameter in _inner(optimizer).state.values():
            yield from (value for value in per_parameter.values() if isinstance(value, torch.Tensor))


__all__ = ["MemoryAccount", "account_memory", "account_parameters", "peak_rss_bytes"]
