"""Switching step timing on or off for an Accelerator: the real timer or one whose hooks do nothing."""

from __future__ import annotations

import contextlib
from typing import Any

from lockstep.throughput.config import ThroughputKwargs
from lockstep.throughput.step_timer import StepTimer


class NullStepTimer:
    """Step timing switched off: every hook does nothing."""

    enabled = False
    _NOTHING = contextlib.nullcontext()

    def watch(self, prepared: Any) -> None:
        pass

    def backward(self) -> contextlib.AbstractContextManager:
        return self._NOTHING

    def checkpoint(self) -> contextlib.AbstractContextManager:
        return self._NOTHING

    @property
    def stats(self) -> dict[str, float]:
        raise RuntimeError(
            "accelerator.step_stats is only measured with step timing on, and it is off (the default). Pass "
            "Accelerator(step_timing=True), or kwargs_handlers=[ThroughputKwargs(...)] to tune it."
        )


def build_step_timer(
    accelerator: Any, step_timing: bool | None, handler: ThroughputKwargs | None
) -> StepTimer | NullStepTimer:
    """The timer for ``accelerator``: a :class:`StepTimer` when switched on, else a do-nothing one.

    Args:
        accelerator: the Accelerator (its prepared objects, trackers and settings are read lazily).
        step_timing: ``Accelerator(step_timing=...)``: True switches on, False off, None follows ``handler``.
        handler: a ``ThroughputKwargs`` from ``kwargs_handlers`` (switches on unless ``step_timing=False``).
    """
    if step_timing is not None and not isinstance(step_timing, bool):
        raise TypeError(f"Accelerator(step_timing={step_timing!r}) is invalid: pass True or False.")
    if step_timing is False and handler is not None:
        raise ValueError(
            "Accelerator(step_timing=False) conflicts with the ThroughputKwargs in kwargs_handlers, which "
            "switches step timing on: remove one of them."
        )
    if not step_timing and handler is None:
        return NullStepTimer()
    return StepTimer(
        handler or ThroughputKwargs(),
        device=accelerator.device,
        num_processes=accelerator.num_processes,
        models=lambda: accelerator._models,
        optimizers=lambda: accelerator._optimizers,
        mixed_precision=lambda: accelerator.mixed_precision,
        log=lambda values, step: accelerator.log(values, step=step),
        logging_active=lambda: bool(accelerator.trackers),
    )
