"""Throughput accounting: per optimizer step, where the time went, samples/s, tokens/s, FLOP/s and MFU.

Off by default. Switch it on with ``Accelerator(step_timing=True)`` (or
``kwargs_handlers=[ThroughputKwargs(...)]`` to tune it) and read ``accelerator.step_stats`` after
``optimizer.step()``; with trackers running, the figures are logged every 10 steps too. The keys and what
they measure are described in :mod:`lockstep.throughput.step_timer`.

Example:
    >>> accelerator = Accelerator(step_timing=True, log_with="jsonl", project_dir="runs/a")  # doctest: +SKIP
    >>> for batch in train_dataloader:  # doctest: +SKIP
    ...     accelerator.backward(model(**batch).loss)
    ...     optimizer.step()
    ...     optimizer.zero_grad()
    ...     print(accelerator.step_stats["time/data"], accelerator.step_stats["samples_per_second"])
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lockstep._lazy import lazy_exports

# Loaded on first use: the Accelerator imports this package for ThroughputKwargs, and the timer itself is
# needed only when step timing is switched on.
_EXPORTS = {
    "NullStepTimer": "lockstep.throughput.build",
    "build_step_timer": "lockstep.throughput.build",
    "ThroughputKwargs": "lockstep.throughput.config",
    "compute_dtype_name": "lockstep.throughput.peak_flops",
    "device_peak_flops": "lockstep.throughput.peak_flops",
    "peak_flops_per_second": "lockstep.throughput.peak_flops",
    "StepTimer": "lockstep.throughput.step_timer",
}

__all__ = [
    "NullStepTimer",
    "StepTimer",
    "ThroughputKwargs",
    "build_step_timer",
    "compute_dtype_name",
    "device_peak_flops",
    "peak_flops_per_second",
]

if TYPE_CHECKING:
    from lockstep.throughput.build import NullStepTimer, build_step_timer
    from lockstep.throughput.config import ThroughputKwargs
    from lockstep.throughput.peak_flops import compute_dtype_name, device_peak_flops, peak_flops_per_second
    from lockstep.throughput.step_timer import StepTimer


__getattr__ = lazy_exports(__name__, _EXPORTS)[0]
