"""A progress bar for training loops: on the main process only, with live samples per second.

Other ranks get a bar that does nothing, so every rank can run the same code. The bar is off when
``LOCKSTEP_DISABLE_PROGRESS_BARS=1`` (batch jobs, CI logs) or when the caller disables it, and when
``tqdm`` is not installed.

Example:
    >>> bar = ProgressBar(total=100, enabled=False)
    >>> bar.update(1, samples=32)
    >>> bar.close()
"""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Iterable, Iterator
from typing import IO, Any, TypeVar

from lockstep import _env


class ProgressBar:
    """A tqdm bar over optimizer steps that shows samples/s (a silent stand-in when disabled).

    Args:
        total: number of steps of the whole bar.
        enabled: False makes every method a no-op (pass ``is_main_process and not disable``).
        description: text before the bar.
        initial: steps already done (when resuming).
    """

    def __init__(
        self,
        total: int | None,
        *,
        enabled: bool = True,
        description: str = "train",
        initial: int = 0,
        file: IO[str] | None = None,
    ) -> None:
        self.enabled = (
            enabled and not _env.progress_bars_disabled() and importlib.util.find_spec("tqdm") is not None
        )
        self._bar: Any = None
        self._samples = 0
        self._started = time.perf_counter()
        if self.enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total,
                initial=initial,
                desc=description,
                dynamic_ncols=True,
                file=file if file is not None else sys.stderr,
            )

    def update(self, steps: int = 1, *, samples: int = 0) -> None:
        """Advance by ``steps`` and count ``samples`` (all processes together) for the rate."""
        if self._bar is None:
            return
        self._samples += samples
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        self._bar.set_postfix({"samples/s": f"{self._samples / elapsed:.1f}"}, refresh=False)
        self._bar.update(steps)

    def write(self, line: str) -> None:
        """Print ``line`` to stdout above the bar (a plain print when the bar is off)."""
        if self._bar is None:
            print(line, flush=True)
            return
        self._bar.write(line, file=sys.stdout)
        sys.stdout.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


T = TypeVar("T")


def progress_bar(
    batches: Iterable[T],
    *,
    description: str = "train",
    disable: bool = False,
    file: IO[str] | None = None,
) -> Iterator[T]:
    """Iterate over ``batches`` (e.g. a prepared dataloader) with a bar on the main process only.

    The bar counts batches and shows the samples per second of the whole job (this process's batch
    sizes times the number of processes). Other processes iterate silently, so every rank runs the same
    code. Off with ``disable=True`` or ``LOCKSTEP_DISABLE_PROGRESS_BARS=1``.

    Example:
        >>> for batch in progress_bar([[1, 2], [3, 4]], disable=True):
        ...     pass
    """
    from lockstep.data.loader import batch_length
    from lockstep.state import PartialState

    state = PartialState()
    total = len(batches) if hasattr(batches, "__len__") else None  # type: ignore[arg-type]
    bar = ProgressBar(
        total, enabled=state.is_main_process and not disable, description=description, file=file
    )
    try:
        for batch in batches:
            yield batch
            bar.update(1, samples=batch_length(batch) * state.num_processes)
    finally:
        bar.close()
