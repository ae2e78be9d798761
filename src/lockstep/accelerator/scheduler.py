"""The prepared learning-rate scheduler.

Accelerate's rule, kept for compatibility and documented because users trip on it:

* The scheduler advances only when the optimizers really stepped (not on accumulation micro-steps,
  not when an fp16 overflow skipped the step).
* When batches are not split (the default), each process sees ``1 / num_processes`` of the batches a
  single process would see, but the schedule was written for the unsharded dataloader. So one real step
  advances the scheduler ``num_processes`` times, and the schedule ends with the data.
* A scheduler built *after* ``prepare`` from the prepared loader's length already counts per-process
  steps: do not prepare it (or pass ``step_scheduler_with_optimizer=False``), and it steps once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lockstep.accelerator.optimizer import AcceleratedOptimizer
from lockstep.state import GradientState


class AcceleratedScheduler:
    """Wraps an LR scheduler so it follows the rule above.

    Args:
        scheduler: the user's scheduler.
        optimizers: the prepared optimizers (to see whether they skipped their step).
        step_with_optimizer: follow the rule above; False steps the scheduler on every ``step()`` call.
        split_batches: batches are split across processes (step once per real step).
        num_processes: the world size.
    """

    def __init__(
        self,
        scheduler: Any,
        optimizers: Sequence[AcceleratedOptimizer],
        step_with_optimizer: bool = True,
        split_batches: bool = False,
        num_processes: int = 1,
    ) -> None:
        self.scheduler = scheduler
        self.optimizers = list(optimizers)
        self.step_with_optimizer = step_with_optimizer
        self.split_batches = split_batches
        self.num_processes = num_processes
        self.gradient_state = GradientState()

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.gradient_state.sync_gradients:
            if self.gradient_state.adjust_scheduler:
                self.scheduler._step_count += 1
            return
        if any(opt.step_was_skipped for opt in self.optimizers):
            return
        repeats = 1 if self.split_batches else self.num_processes
        for _ in range(repeats):
            total_steps = getattr(self.scheduler, "total_steps", None)  # OneCycleLR raises past its end
            if total_steps is not None and self.scheduler._step_count > total_steps:
                break
            self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def get_lr(self) -> Any:
        return self.scheduler.get_lr()

    def print_lr(self, *args: Any, **kwargs: Any) -> Any:
        return self.scheduler.print_lr(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)
