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

from lockstep.throughput.build import NullStepTimer, build_step_timer
from lockstep.throughput.config import ThroughputKwargs
from lockstep.throughput.peak_flops import compute_dtype_name, device_peak_flops, peak_flops_per_second
from lockstep.throughput.step_timer import StepTimer

__all__ = [
    "NullStepTimer",
    "StepTimer",
    "ThroughputKwargs",
    "build_step_timer",
    "compute_dtype_name",
    "device_peak_flops",
    "peak_flops_per_second",
]
