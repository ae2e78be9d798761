"""Clocks that mark instants of a training step and measure the time between two marks.

On the CPU a mark is ``time.perf_counter()``. On CUDA a mark is a CUDA event recorded on the current
stream: the time between two marks is then the time the *device* spent between them, which is what
matters when the host runs ahead of the device. Events are read only at the end of a step, after
waiting for that step's last event, so accounting adds one synchronisation per optimizer step and none
inside it. Other accelerators (``mps``, ``xpu``, ...) wait for the device at every mark instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


class CpuClock:
    """Wall-clock marks (``time.perf_counter``)."""

    def mark(self) -> Any:
        return time.perf_counter()

    def elapsed(self, start: Any, end: Any) -> float:
        """Seconds from ``start`` to ``end``."""
        return end - start

    def wait(self, mark: Any) -> None:
        """Make ``mark`` readable (nothing to wait for on the CPU)."""


class CudaClock(CpuClock):
    """Device-timeline marks: CUDA events with timing, recorded on the current stream of ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def elapsed(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1000.0

    def wait(self, mark: Any) -> None:
        """Block until the device has reached ``mark`` (so that every earlier mark can be read)."""
        mark.synchronize()


class SynchronizingClock(CpuClock):
    """Wall-clock marks taken after waiting for the device (accelerators without timing events here).

    Args:
        synchronize: waits for the device (``torch.mps.synchronize``, ``torch.xpu.synchronize``, ...).
    """

    def __init__(self, synchronize: Callable[[], None]) -> None:
        self.synchronize = synchronize

    def mark(self) -> Any:
        self.synchronize()
        return time.perf_counter()


def clock_for(device: torch.device) -> CpuClock:
    """The clock that measures steps on ``device``: events on CUDA, synchronised wall clock on other
    accelerators (``mps``, ``xpu``, ...), plain wall clock on the CPU."""
    if device.type == "cuda":
        return CudaClock(device)
    synchronize = getattr(getattr(torch, device.type, None), "synchronize", None)
    if device.type == "cpu" or synchronize is None:
        return CpuClock()
    return SynchronizingClock(synchronize)
