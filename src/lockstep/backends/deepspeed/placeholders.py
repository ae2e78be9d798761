"""``DummyOptim`` and ``DummyScheduler``: stand-ins for the optimizer and scheduler of a DeepSpeed config.

A training loop written for any backend creates an optimizer and a scheduler; when the DeepSpeed config
defines them, the loop creates these instead and ``prepare`` returns wrappers of the ones DeepSpeed built.

Example:
    >>> import torch
    >>> optimizer = DummyOptim(torch.nn.Linear(2, 2).parameters(), lr=3e-4)
    >>> optimizer.lr, DummyScheduler(optimizer, total_num_steps=100, warmup_num_steps=10).warmup_num_steps
    (0.0003, 10)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any


class DummyOptim:
    """The DeepSpeed config's optimizer, in code.

    Args:
        params: the parameters (or parameter groups) to optimize.
        lr: fills the config's ``"auto"`` ``optimizer.params.lr``.
        weight_decay: fills the config's ``"auto"`` ``optimizer.params.weight_decay``.
        **kwargs: kept, unused (as in Accelerate).
    """

    def __init__(
        self, params: Iterable[Any], lr: float = 0.001, weight_decay: float = 0, **kwargs: Any
    ) -> None:
        self.params = params
        self.lr = lr
        self.weight_decay = weight_decay
        self.kwargs = kwargs


class DummyScheduler:
    """The DeepSpeed config's scheduler, in code (or a callable that builds one from the optimizer).

    Args:
        optimizer: the ``DummyOptim`` it schedules.
        total_num_steps: fills ``"auto"`` ``scheduler.params.total_num_steps`` (divided by the number of
            processes unless batches are split, as Accelerate does).
        warmup_num_steps: fills ``"auto"`` ``scheduler.params.warmup_num_steps``.
        lr_scheduler_callable: ``optimizer -> scheduler``, used instead of a config scheduler.
        **kwargs: kept, unused.
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int | None = None,
        warmup_num_steps: int = 0,
        lr_scheduler_callable: Callable[[Any], Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = warmup_num_steps
        self.lr_scheduler_callable = lr_scheduler_callable
        self.kwargs = kwargs
