"""Stopping cleanly when the cluster asks: a signal sets a flag, all ranks agree at the next step.

The signal handler does nothing but set a flag (no I/O, no collectives: it may interrupt anything).
:meth:`PreemptionWatcher.should_stop` is called by every rank at the same point of the loop (after
``optimizer.step()``); one small all-reduce makes every rank see the stop at the same step even if the
signal reached only some of them, so they can save one consistent checkpoint and exit with
``128 + signal`` (143 for SIGTERM).

The handlers are installed the first time a loop asks (opting in), so a script that never checks keeps
the default behaviour of SIGTERM.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")


def parse_signals(names: Sequence[str | int | signal.Signals]) -> list[signal.Signals]:
    """Turn ``["SIGTERM", "SIGUSR1"]`` (names, numbers or members) into signal members."""
    parsed = []
    for name in names:
        try:
            parsed.append(
                signal.Signals(name) if isinstance(name, int) else signal.Signals[str(name).upper()]
            )
        except (KeyError, ValueError):
            raise ValueError(
                f"preemption_signals got {name!r}, which is not a signal; use names such as 'SIGTERM' or 'SIGUSR1'."
            ) from None
    return parsed


def _nothing() -> None:
    pass


class PreemptionWatcher:
    """Records a preemption signal and lets all ranks agree on stopping.

    Args:
        signals: the signals that mean "stop soon" (default SIGTERM and SIGUSR1).
        grace_period: seconds the cluster waits after the signal before killing; a save that takes
            longer is reported.
    """

    def __init__(self, signals: Sequence[Any] = DEFAULT_SIGNALS, grace_period: float = 30.0) -> None:
        self.signals = parse_signals(signals)
        if grace_period <= 0:
            raise ValueError(f"preemption_grace_period={grace_period} is invalid: it must be > 0 seconds.")
        self.grace_period = grace_period
        self.received: signal.Signals | None = None
        self.received_at: float | None = None
        self._installed = False
        self._agreed = False

    def install(self) -> None:
        """Install the flag-setting handlers (once, from the main thread)."""
        if self._installed or threading.current_thread() is not threading.main_thread():
            return
        for sig in self.signals:
            signal.signal(sig, self._on_signal)
        self._installed = True

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)
            self.received_at = time.monotonic()

    def should_stop(
        self,
        device: torch.device,
        *,
        save_failed: bool = False,
        on_save_failure: Callable[[], None] = _nothing,
    ) -> bool:
        """True on every rank once any rank received a preemption signal (one all-reduce per call).

        Args:
            save_failed: this rank's background checkpoint save failed; shared in the same all-reduce.
            on_save_failure: called on every rank when that is true on some rank (it raises the error).
        """
        self.install()
        if self._agreed:
            return True
        local = 0 if self.received is None else int(self.received)
        failed = int(save_failed)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([local, failed], dtype=torch.int64, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            local, failed = int(flag[0].item()), int(flag[1].item())
        if failed:
            on_save_failure()
        if local:
            self._agreed = True
            if self.received is None:  # another rank got it; remember which signal for the exit code
                self.received = signal.Signals(local)
                self.received_at = time.monotonic()
        return self._agreed

    @property
    def exit_code(self) -> int:
        return 128 + int(self.received or signal.SIGTERM)

    def report_save(self, seconds: float) -> str | None:
        """A warning text when a save after the signal outlasted the grace period."""
        if self.received_at is None:
            return None
        elapsed = time.monotonic() - self.received_at
        if elapsed <= self.grace_period:
            return None
        return (
            f"The checkpoint after {self.received.name if self.received else 'the signal'} took {seconds:.1f} s "
            f"({elapsed:.1f} s since the signal), longer than the {self.grace_period:.0f} s grace period: the "
            "cluster may kill the job before it finishes. Save more often or raise preemption_grace_period."
        )


def exit_now(code: int) -> None:
    """Flush and exit with ``code`` (the process group was already shut down)."""
    sys.stdout.flush()
    sys.stderr.flush()
    raise SystemExit(code)
