"""Switching step timing on or off for an Accelerator: the real timer or one whose hooks do nothing."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lockstep.throughput.config import ThroughputKwargs

if TYPE_CHECKING:
    import torch

    from lockstep.throughput.step_timer import StepTimer


class NullStepTimer:
    """Step timing switched off: not among the Accelerator's step hooks, and its checkpoint window does
    nothing."""

    enabled = False
    _NOTHING = contextlib.nullcontext()

    def checkpoint(self) -> contextlib.AbstractContextManager:
        return self._NOTHING

    @property
    def stats(self) -> dict[str, float]:
        raise RuntimeError(
            "accelerator.step_stats is only measured with step timing on, and it is off (the default). Pass "
            "Accelerator(step_timing=True), or kwargs_handlers=[ThroughputKwargs(...)] to tune it."
        )


def build_step_timer(
    step_timing: bool | None,
    handler: ThroughputKwargs | None,
    *,
    device: torch.device,
    num_processes: int,
    prepared: Any,
    mixed_precision: str,
    log: Callable[[dict[str, float], int], None],
    logging_active: Callable[[], bool],
) -> StepTimer | NullStepTimer:
    """A :class:`StepTimer` when step timing is switched on, else a do-nothing one (the timer's module is
    imported only then).

    Args:
        step_timing: ``Accelerator(step_timing=...)``: True switches on, False off, None follows ``handler``.
        handler: a ``ThroughputKwargs`` from ``kwargs_handlers`` (switches on unless ``step_timing=False``).
        device: the training device (its clock times the steps).
        num_processes: the world size (samples/s count every process).
        prepared: the registry of prepared objects (its ``models`` and ``optimizers`` are read at each step).
        mixed_precision: the training precision (for the peak FLOP/s of MFU).
        log: where figures go (the Accelerator's trackers).
        logging_active: whether any tracker was started.
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
    from lockstep.throughput.step_timer import StepTimer

    return StepTimer(
        handler or ThroughputKwargs(),
        device=device,
        num_processes=num_processes,
        models=lambda: prepared.models,
        optimizers=lambda: prepared.optimizers,
        mixed_precision=lambda: mixed_precision,
        log=log,
        logging_active=logging_active,
    )
