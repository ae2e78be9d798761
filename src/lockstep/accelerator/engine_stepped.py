"""The optimizer and scheduler the user holds when the model's engine steps them (DeepSpeed).

``accelerator.backward`` runs the engine's backward and, on the last micro-batch of a cycle, its step
(gradient reduction, clipping, optimizer and scheduler step, zeroing). The loop's ``optimizer.step()``,
``optimizer.zero_grad()`` and ``scheduler.step()`` stay in place, so the same loop runs on every backend:
here they only note the step (for the hang watchdog and step timing) and report overflow.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lockstep.accelerator.optimizer import AcceleratedOptimizer
from lockstep.accelerator.scheduler import AcceleratedScheduler
from lockstep.step_hooks import StepHooks


class DeepSpeedOptimizerWrapper(AcceleratedOptimizer):
    """The engine's optimizer: ``step`` and ``zero_grad`` are the engine's, done in ``backward``.

    Args:
        optimizer: the engine's optimizer (a ZeRO optimizer wrapping the torch one).
        step_hooks: the Accelerator's step hooks, run around every real step (the hang watchdog, the step
            timer).
    """

    def __init__(self, optimizer: Any, *, step_hooks: StepHooks | None = None) -> None:
        super().__init__(optimizer, device_placement=False, scaler=None, step_hooks=step_hooks)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        return None  # the engine zeroes the gradients after its step

    def _synchronized_step(self, closure: Callable[[], float] | None) -> Any:
        self._is_overflow = bool(getattr(self.optimizer, "overflow", False))
        return None

    @property
    def step_was_skipped(self) -> bool:
        """Whether the engine skipped its last step because fp16 gradients overflowed."""
        return bool(getattr(self.optimizer, "overflow", False))

    def __repr__(self) -> str:
        return f"DeepSpeedOptimizerWrapper({type(self.optimizer).__name__})"


class DeepSpeedSchedulerWrapper(AcceleratedScheduler):
    """A scheduler the engine steps (one of DeepSpeed's, or the config's): ``step`` does nothing."""

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None


class DeepSpeedEngineWrapper:
    """Accelerate's helper that runs an engine's backward and step; lockstep's backend does this in
    ``accelerator.backward``, and this class is kept for code that builds one.

    Args:
        engine: a ``deepspeed.DeepSpeedEngine``.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def backward(self, loss: Any, sync_gradients: bool = True, **kwargs: Any) -> None:
        self.engine.set_gradient_accumulation_boundary(is_boundary=sync_gradients)
        self.engine.backward(loss, **kwargs)
        if sync_gradients:
            self.engine.step()

    def get_global_grad_norm(self) -> Any:
        return self.engine.get_global_grad_norm()
