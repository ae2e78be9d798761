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
from typing import Any

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
        self, total: int | None, *, enabled: bool = True, description: str = "train", initial: int = 0
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
                total=total, initial=initial, desc=description, dynamic_ncols=True, file=sys.stderr
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
