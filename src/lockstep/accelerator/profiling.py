"""``Accelerator.profile()``: a ``torch.profiler`` session configured by ``ProfileKwargs``, with one Chrome
trace per process.

Example:
    >>> import torch
    >>> from lockstep.config.kwargs import ProfileKwargs
    >>> with profile(ProfileKwargs(activities=["cpu"]), process_index=0, barrier=lambda: None) as prof:
    ...     _ = torch.ones(8, 8) @ torch.ones(8, 8)
    >>> any(event.key == "aten::mm" for event in prof.key_averages())
    True
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch.profiler

from lockstep.config.kwargs import PROFILE_PATTERN_NAME, ProfileKwargs


def trace_path(output_trace_dir: str | Path, process_index: int) -> Path:
    """Where process ``process_index`` writes its Chrome trace (``profile_<rank>.json``, as Accelerate)."""
    return Path(output_trace_dir) / PROFILE_PATTERN_NAME.format(suffix=process_index)


@contextmanager
def profile(
    handler: ProfileKwargs, *, process_index: int, barrier: Callable[[], None]
) -> Iterator[torch.profiler.profile]:
    """Profile the block with ``handler``'s settings; yields the running ``torch.profiler.profile``.

    When ``handler.output_trace_dir`` is set, each process writes its trace there after the block, then all
    processes wait for each other (so that the folder is complete when any of them goes on).

    Args:
        handler: the profiler settings.
        process_index: this process's rank (names the trace file).
        barrier: waits for every process (``wait_for_everyone``).
    """
    with handler.build() as profiler:
        yield profiler
    if handler.output_trace_dir is None:
        return
    path = trace_path(handler.output_trace_dir, process_index)
    path.parent.mkdir(parents=True, exist_ok=True)
    if profiler.profiler is None:
        raise RuntimeError(
            f"profile(): nothing was recorded, so no trace can be written to {path}. With "
            f"schedule_option={handler.schedule_option}, call prof.step() after each step, at least "
            "skip_first + wait + warmup + active times."
        )
    profiler.export_chrome_trace(str(path))
    barrier()
