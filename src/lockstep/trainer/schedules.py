"""Learning-rate schedules (transformers' names and formulas), as ``torch.optim.lr_scheduler.LambdaLR``
(``reduce_lr_on_plateau``: torch's ``ReduceLROnPlateau``).

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
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, ReduceLROnPlateau

from lockstep.trainer._arguments_post_init import LR_SCHEDULER_TYPES, SCHEDULE_KWARGS


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


def _cosine(
    step: int, *, num_warmup_steps: int, num_training_steps: int, num_cycles: float, min_lr_rate: float = 0.0
) -> float:
    if step < num_warmup_steps:
        return step / max(1, num_warmup_steps)
    progress = (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps)
    factor = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))
    return max(0.0, factor * (1.0 - min_lr_rate) + min_lr_rate)


def _cosine_with_restarts(
    step: int, *, num_warmup_steps: int, num_training_steps: int, num_cycles: int
) -> float:
    if step < num_warmup_steps:
        return step / max(1, num_warmup_steps)
    progress = (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps)
    if progress >= 1.0:
        return 0.0
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((num_cycles * progress) % 1.0))))


def _polynomial(
    step: int, *, num_warmup_steps: int, num_training_steps: int, lr_end: float, power: float, lr_init: float
) -> float:
    if step < num_warmup_steps:
        return step / max(1, num_warmup_steps)
    if step > num_training_steps:
        return lr_end / lr_init
    remaining = 1 - (step - num_warmup_steps) / (num_training_steps - num_warmup_steps)
    return ((lr_init - lr_end) * remaining**power + lr_end) / lr_init


def _inverse_sqrt(step: int, *, num_warmup_steps: int, timescale: int) -> float:
    if step < num_warmup_steps:
        return step / max(1, num_warmup_steps)
    return 1.0 / math.sqrt((step + timescale - num_warmup_steps) / timescale)


def _cosine_warmup_with_min_lr(
    step: int,
    *,
    num_warmup_steps: int,
    num_training_steps: int,
    num_cycles: float,
    min_lr_rate: float,
    warmup_lr_rate: float | None,
) -> float:
    """Warm-up that reaches the peak on its last step (not one after), then cosine down to ``min_lr_rate``."""
    if step < num_warmup_steps:
        if warmup_lr_rate is None:
            return (step + 1.0) / max(1.0, num_warmup_steps)
        return warmup_lr_rate + (1.0 - warmup_lr_rate) * step / max(1, num_warmup_steps - 1)
    progress = (step - num_warmup_steps + 1.0) / max(1.0, num_training_steps - num_warmup_steps)
    factor = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))
    return max(0.0, factor * (1.0 - min_lr_rate) + min_lr_rate)


def _ramp(shape: str, progress: float) -> float:
    """0 -> 1 over ``progress`` in [0, 1] for the warm-up shapes of warmup_stable_decay."""
    if shape == "linear":
        return progress
    if shape == "cosine":
        return 0.5 * (1.0 - math.cos(math.pi * progress))
    return 1.0 - math.sqrt(1.0 - progress)  # "1-sqrt"


def _decay(shape: str, progress: float, num_cycles: float) -> float:
    """1 -> 0 over ``progress`` in [0, 1] for the decay shapes of warmup_stable_decay."""
    if shape == "linear":
        return 1.0 - progress
    if shape == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))
    return 1.0 - math.sqrt(progress)  # "1-sqrt"


def _warmup_stable_decay(
    step: int,
    *,
    num_warmup_steps: int,
    num_stable_steps: int,
    num_decay_steps: int,
    warmup_type: str,
    decay_type: str,
    min_lr_ratio: float,
    num_cycles: float,
) -> float:
    if step < num_warmup_steps:
        factor = _ramp(warmup_type, step / max(1, num_warmup_steps))
        return max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)
    if step < num_warmup_steps + num_stable_steps:
        return 1.0
    if step < num_warmup_steps + num_stable_steps + num_decay_steps:
        progress = (step - num_warmup_steps - num_stable_steps) / max(1, num_decay_steps)
        factor = _decay(decay_type, progress, num_cycles)
        return max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)
    return min_lr_ratio


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


def get_cosine_with_hard_restarts_schedule_with_warmup(
    optimizer: Optimizer,
    num_warmup_steps: int,
    num_training_steps: int,
    num_cycles: int = 1,
    last_epoch: int = -1,
) -> LambdaLR:
    """Linear warm-up, then ``num_cycles`` cosine decays to 0, each restarting at the peak."""
    multiplier = functools.partial(
        _cosine_with_restarts,
        num_warmup_steps=num_warmup_steps,
        num_training_steps=num_training_steps,
        num_cycles=num_cycles,
    )
    return LambdaLR(optimizer, multiplier, last_epoch)


def get_polynomial_decay_schedule_with_warmup(
    optimizer: Optimizer,
    num_warmup_steps: int,
    num_training_steps: int,
    lr_end: float = 1e-7,
    power: float = 1.0,
    last_epoch: int = -1,
) -> LambdaLR:
    """Linear warm-up, then ``(lr - lr_end) * remaining**power + lr_end`` down to ``lr_end``."""
    lr_init = optimizer.defaults["lr"]
    if not lr_init > lr_end:
        raise ValueError(
            f"lr_scheduler_type='polynomial' with lr_end={lr_end}: lr_end must be below the learning rate "
            f"({lr_init}). Pass a smaller lr_end in lr_scheduler_kwargs."
        )
    multiplier = functools.partial(
        _polynomial,
        num_warmup_steps=num_warmup_steps,
        num_training_steps=num_training_steps,
        lr_end=lr_end,
        power=power,
        lr_init=lr_init,
    )
    return LambdaLR(optimizer, multiplier, last_epoch)


def get_inverse_sqrt_schedule(
    optimizer: Optimizer, num_warmup_steps: int, timescale: int | None = None, last_epoch: int = -1
) -> LambdaLR:
    """Linear warm-up, then ``1 / sqrt((step + timescale - warmup) / timescale)``."""
    if timescale is None:
        timescale = num_warmup_steps or 10_000
    multiplier = functools.partial(_inverse_sqrt, num_warmup_steps=num_warmup_steps, timescale=timescale)
    return LambdaLR(optimizer, multiplier, last_epoch)


def _min_lr_rate(optimizer: Optimizer, min_lr: float | None, min_lr_rate: float | None, name: str) -> float:
    if (min_lr is None) == (min_lr_rate is None):
        raise ValueError(
            f"lr_scheduler_type={name!r} needs exactly one of min_lr and min_lr_rate in lr_scheduler_kwargs "
            f'(got min_lr={min_lr}, min_lr_rate={min_lr_rate}), e.g. {{"min_lr_rate": 0.1}}.'
        )
    return min_lr / optimizer.defaults["lr"] if min_lr is not None else float(min_lr_rate)  # type: ignore[arg-type]


def get_cosine_with_min_lr_schedule_with_warmup(
    optimizer: Optimizer,
    num_warmup_steps: int,
    num_training_steps: int,
    num_cycles: float = 0.5,
    last_epoch: int = -1,
    min_lr: float | None = None,
    min_lr_rate: float | None = None,
) -> LambdaLR:
    """Cosine decay that ends at ``min_lr`` (or ``min_lr_rate`` times the learning rate) instead of 0."""
    multiplier = functools.partial(
        _cosine,
        num_warmup_steps=num_warmup_steps,
        num_training_steps=num_training_steps,
        num_cycles=num_cycles,
        min_lr_rate=_min_lr_rate(optimizer, min_lr, min_lr_rate, "cosine_with_min_lr"),
    )
    return LambdaLR(optimizer, multiplier, last_epoch)


def get_cosine_with_min_lr_schedule_with_warmup_lr_rate(
    optimizer: Optimizer,
    num_warmup_steps: int,
    num_training_steps: int,
    num_cycles: float = 0.5,
    last_epoch: int = -1,
    min_lr: float | None = None,
    min_lr_rate: float | None = None,
    warmup_lr_rate: float | None = None,
) -> LambdaLR:
    """As ``cosine_with_min_lr``, with a warm-up that starts at ``warmup_lr_rate`` and peaks on its last step."""
    multiplier = functools.partial(
        _cosine_warmup_with_min_lr,
        num_warmup_steps=num_warmup_steps,
        num_training_steps=num_training_steps,
        num_cycles=num_cycles,
        min_lr_rate=_min_lr_rate(optimizer, min_lr, min_lr_rate, "cosine_warmup_with_min_lr"),
        warmup_lr_rate=warmup_lr_rate,
    )
    return LambdaLR(optimizer, multiplier, last_epoch)


_SHAPES = ("linear", "cosine", "1-sqrt")


def get_wsd_schedule(
    optimizer: Optimizer,
    num_warmup_steps: int,
    num_decay_steps: int,
    num_training_steps: int | None = None,
    num_stable_steps: int | None = None,
    warmup_type: str = "linear",
    decay_type: str = "cosine",
    min_lr_ratio: float = 0.0,
    num_cycles: float = 0.5,
    last_epoch: int = -1,
) -> LambdaLR:
    """Warm-up, a stable plateau, then a decay to ``min_lr_ratio`` (warmup_stable_decay)."""
    for name, shape in (("warmup_type", warmup_type), ("decay_type", decay_type)):
        if shape not in _SHAPES:
            raise ValueError(
                f"lr_scheduler_type='warmup_stable_decay' with {name}={shape!r}: use one of {', '.join(_SHAPES)}."
            )
    if num_stable_steps is None:
        if num_training_steps is None:
            raise ValueError("warmup_stable_decay needs num_training_steps or num_stable_steps.")
        num_stable_steps = num_training_steps - num_warmup_steps - num_decay_steps
    multiplier = functools.partial(
        _warmup_stable_decay,
        num_warmup_steps=num_warmup_steps,
        num_stable_steps=num_stable_steps,
        num_decay_steps=num_decay_steps,
        warmup_type=warmup_type,
        decay_type=decay_type,
        min_lr_ratio=min_lr_ratio,
        num_cycles=num_cycles,
    )
    return LambdaLR(optimizer, multiplier, last_epoch)


def get_reduce_on_plateau_schedule(optimizer: Optimizer, **kwargs: Any) -> ReduceLROnPlateau:
    """torch's ``ReduceLROnPlateau``; the Trainer steps it with ``metric_for_best_model`` after each evaluation."""
    return ReduceLROnPlateau(optimizer, **kwargs)


_SCHEDULES: dict[str, Callable[..., Any]] = {
    "linear": get_linear_schedule_with_warmup,
    "cosine": get_cosine_schedule_with_warmup,
    "cosine_with_restarts": get_cosine_with_hard_restarts_schedule_with_warmup,
    "polynomial": get_polynomial_decay_schedule_with_warmup,
    "constant": get_constant_schedule,
    "constant_with_warmup": get_constant_schedule_with_warmup,
    "inverse_sqrt": get_inverse_sqrt_schedule,
    "reduce_lr_on_plateau": get_reduce_on_plateau_schedule,
    "cosine_with_min_lr": get_cosine_with_min_lr_schedule_with_warmup,
    "cosine_warmup_with_min_lr": get_cosine_with_min_lr_schedule_with_warmup_lr_rate,
    "warmup_stable_decay": get_wsd_schedule,
}
assert tuple(_SCHEDULES) == LR_SCHEDULER_TYPES


def get_scheduler(
    name: str,
    optimizer: Optimizer,
    num_warmup_steps: int | None = 0,
    num_training_steps: int | None = None,
    scheduler_specific_kwargs: dict[str, Any] | None = None,
) -> Any:
    """The schedule called ``name`` (transformers' ``get_scheduler``); ``scheduler_specific_kwargs`` are
    the ``lr_scheduler_kwargs`` of :class:`TrainingArguments`."""
    if name not in _SCHEDULES:
        raise ValueError(f"get_scheduler({name!r}): unknown schedule; use one of {', '.join(_SCHEDULES)}.")
    kwargs = dict(scheduler_specific_kwargs or {})
    unknown = sorted(set(kwargs) - set(SCHEDULE_KWARGS[name]))
    if unknown:
        raise ValueError(
            f"get_scheduler({name!r}) does not take {', '.join(unknown)}; it takes: "
            f"{', '.join(SCHEDULE_KWARGS[name]) or 'nothing'}."
        )
    if name in ("constant", "reduce_lr_on_plateau"):
        return _SCHEDULES[name](optimizer, **kwargs)
    warmup = num_warmup_steps or 0
    if name in ("constant_with_warmup", "inverse_sqrt"):
        return _SCHEDULES[name](optimizer, num_warmup_steps=warmup, **kwargs)
    if num_training_steps is None and name != "warmup_stable_decay":
        raise ValueError(f"get_scheduler({name!r}) needs num_training_steps: the schedule decays to its end.")
    return _SCHEDULES[name](
        optimizer, num_warmup_steps=warmup, num_training_steps=num_training_steps, **kwargs
    )
