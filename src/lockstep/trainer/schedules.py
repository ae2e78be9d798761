"""Learning-rate schedules (transformers' names and formulas), as ``torch.optim.lr_scheduler.LambdaLR``.

Each multiplier is a ``functools.partial`` of a module-level function, so the scheduler's state dict
holds plain values and loads with ``torch.load(weights_only=True)``.

Example:
    >>> import torch
    >>> optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    >>> scheduler = get_scheduler("linear", optimizer, num_warmup_steps=2, num_training_steps=10)
    >>> rates = []
    >>> for _ in range(3):
    ...     optimizer.step()
    ...     scheduler.step()
    ...     rates.append(round(scheduler.get_last_lr()[0], 3))
    >>> rates
    [0.5, 1.0, 0.875]
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def _constant(step: int) -> float:
    return 1.0


def _constant_with_warmup(step: int, *, num_warmup_steps: int) -> float:
    if step < num_warmup_steps:
        return step / max(1, num_warmup_steps)
    return 1.0


def _linear(step: int, *, num_warmup_steps: int, num_training_steps: int) -> float:
    if step < num_warmup_steps:
        return step / max(1, num_warmup_steps)
    return max(0.0, (num_training_steps - step) / max(1, num_training_steps - num_warmup_steps))


def _cosine(step: int, *, num_warmup_steps: int, num_training_steps: int, num_cycles: float) -> float:
    if step < num_warmup_steps:
        return step / max(1, num_warmup_steps)
    progress = (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress)))


def get_constant_schedule(optimizer: Optimizer, last_epoch: int = -1) -> LambdaLR:
    """The learning rate stays at its initial value."""
    return LambdaLR(optimizer, _constant, last_epoch=last_epoch)


def get_constant_schedule_with_warmup(
    optimizer: Optimizer, num_warmup_steps: int, last_epoch: int = -1
) -> LambdaLR:
    """Linear warm-up from 0 over ``num_warmup_steps``, then constant."""
    return LambdaLR(
        optimizer, functools.partial(_constant_with_warmup, num_warmup_steps=num_warmup_steps), last_epoch
    )


def get_linear_schedule_with_warmup(
    optimizer: Optimizer, num_warmup_steps: int, num_training_steps: int, last_epoch: int = -1
) -> LambdaLR:
    """Linear warm-up from 0, then linear decay to 0 at ``num_training_steps``."""
    multiplier = functools.partial(
        _linear, num_warmup_steps=num_warmup_steps, num_training_steps=num_training_steps
    )
    return LambdaLR(optimizer, multiplier, last_epoch)


def get_cosine_schedule_with_warmup(
    optimizer: Optimizer,
    num_warmup_steps: int,
    num_training_steps: int,
    num_cycles: float = 0.5,
    last_epoch: int = -1,
) -> LambdaLR:
    """Linear warm-up from 0, then a cosine decay (half a cycle by default: down to 0 at the end)."""
    multiplier = functools.partial(
        _cosine,
        num_warmup_steps=num_warmup_steps,
        num_training_steps=num_training_steps,
        num_cycles=num_cycles,
    )
    return LambdaLR(optimizer, multiplier, last_epoch)


_SCHEDULES: dict[str, Callable[..., LambdaLR]] = {
    "linear": get_linear_schedule_with_warmup,
    "cosine": get_cosine_schedule_with_warmup,
    "constant": get_constant_schedule,
    "constant_with_warmup": get_constant_schedule_with_warmup,
}


def get_scheduler(
    name: str, optimizer: Optimizer, num_warmup_steps: int = 0, num_training_steps: int | None = None
) -> LambdaLR:
    """The schedule called ``name`` (``linear``, ``cosine``, ``constant``, ``constant_with_warmup``)."""
    if name not in _SCHEDULES:
        raise ValueError(f"get_scheduler({name!r}): unknown schedule; use one of {', '.join(_SCHEDULES)}.")
    if name == "constant":
        return get_constant_schedule(optimizer)
    if name == "constant_with_warmup":
        return get_constant_schedule_with_warmup(optimizer, num_warmup_steps)
    if num_training_steps is None:
        raise ValueError(f"get_scheduler({name!r}) needs num_training_steps: the schedule decays to its end.")
    return _SCHEDULES[name](optimizer, num_warmup_steps, num_training_steps)
