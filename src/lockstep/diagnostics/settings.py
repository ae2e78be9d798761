"""``HangDetectionKwargs``: when the hang watchdog fires, where it writes, how long it waits for peers.

Kept free of torch imports so that the config layer can load it cheaply.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from lockstep.config.kwargs import KwargsHandler

DEFAULT_MIN_TIMEOUT = 900.0
"""Automatic windows are never shorter than this many seconds (15 minutes)."""
DEFAULT_MULTIPLIER = 20.0
DEFAULT_HISTORY = 64
DEFAULT_REPORT_GRACE = 10.0


@dataclass(kw_only=True)
class HangDetectionKwargs(KwargsHandler):
    """Settings of the hang watchdog (one thread per rank, on whenever more than one process runs).

    When no optimizer step and no collective completes on a rank within the window, every rank writes
    its Python stacks (all threads) and its last collectives to ``<dir>/rank_<r>.txt`` (and ``.json``),
    one line names which rank waits in which collective, and the job exits with code 124. A
    process-group timeout (``InitProcessGroupKwargs(timeout=...)``) produces the same report.

    ``LOCKSTEP_HANG_TIMEOUT`` (seconds; ``0`` or ``off`` switches the watchdog off) applies when
    ``timeout`` and ``enabled`` are not set here.

    Example:
        >>> handler = HangDetectionKwargs(timeout=120)  # report after 2 minutes without progress
        >>> # accelerator = Accelerator(kwargs_handlers=[handler])
    """

    enabled: bool | None = None
    """Switch the watchdog on or off; None follows ``LOCKSTEP_HANG_TIMEOUT`` (on unless it says off)."""
    timeout: float | None = None
    """Seconds without progress before a hang is reported; None: automatic (``timeout_multiplier`` times
    the median step time, at least ``min_timeout``)."""
    timeout_multiplier: float = DEFAULT_MULTIPLIER
    """Automatic window: this many median step times."""
    min_timeout: float = DEFAULT_MIN_TIMEOUT
    """Automatic window: never shorter than this many seconds."""
    history: int = DEFAULT_HISTORY
    """How many of the last collectives each rank keeps and writes out."""
    dump_dir: str | None = None
    """Folder of the per-rank files; default ``<logging_dir>/lockstep_hang``, else ``./lockstep_hang``."""
    report_grace: float = DEFAULT_REPORT_GRACE
    """Seconds a rank waits for the other ranks' reports before summarizing without them."""

    def __post_init__(self) -> None:
        for name in ("timeout", "timeout_multiplier", "min_timeout", "report_grace"):
            value = getattr(self, name)
            if value is None and name == "timeout":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise TypeError(f"HangDetectionKwargs({name}={value!r}) must be a finite number of seconds.")
            if value <= 0:
                raise ValueError(
                    f"HangDetectionKwargs({name}={value!r}) is invalid: it must be > 0. "
                    "Use enabled=False to switch the watchdog off."
                )
        if isinstance(self.history, bool) or not isinstance(self.history, int) or self.history < 1:
            raise ValueError(
                f"HangDetectionKwargs(history={self.history!r}) is invalid: it must be an integer >= 1."
            )


@dataclass(frozen=True)
class WatchdogPlan:
    """The resolved settings one rank's watchdog runs with."""

    timeout: float | None
    timeout_multiplier: float
    min_timeout: float
    history: int
    dump_dir: str
    report_grace: float

    def window(self, median_step: float | None) -> float:
        """Seconds without progress that count as a hang, given the median step time so far."""
        if self.timeout is not None:
            return self.timeout
        if median_step is None:
            return self.min_timeout
        return max(self.min_timeout, self.timeout_multiplier * median_step)


def resolve_plan(
    handler: HangDetectionKwargs | None, env_timeout: float | bool | None, logging_dir: str | None
) -> WatchdogPlan | None:
    """The watchdog's settings, or None when it is switched off.

    Args:
        handler: the user's ``HangDetectionKwargs``, if any.
        env_timeout: what ``LOCKSTEP_HANG_TIMEOUT`` says: seconds, False for "off", None when unset.
        logging_dir: the project's logging folder, if any.
    """
    handler = handler if handler is not None else HangDetectionKwargs()
    enabled = handler.enabled if handler.enabled is not None else env_timeout is not False
    if not enabled:
        return None
    timeout = handler.timeout
    if timeout is None and env_timeout not in (None, False):
        timeout = float(env_timeout)
    dump_dir = handler.dump_dir or _default_dump_dir(logging_dir)
    return WatchdogPlan(
        timeout=timeout,
        timeout_multiplier=float(handler.timeout_multiplier),
        min_timeout=float(handler.min_timeout),
        history=handler.history,
        dump_dir=dump_dir,
        report_grace=float(handler.report_grace),
    )


def _default_dump_dir(logging_dir: str | None) -> str:
    return os.path.join(logging_dir, "lockstep_hang") if logging_dir else os.path.abspath("lockstep_hang")
