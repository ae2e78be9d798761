"""The process's one hang watchdog: started by the Accelerator, told about steps by its step hook."""

from __future__ import annotations

import sys
from types import TracebackType
from typing import final

import torch.distributed as dist

from lockstep import _env
from lockstep.diagnostics.exchange import PeerExchange
from lockstep.diagnostics.settings import HangDetectionKwargs, resolve_plan
from lockstep.diagnostics.watchdog import HangWatchdog
from lockstep.step_hooks import StepHook

_watchdog: HangWatchdog | None = None


def start(
    *, rank: int, world_size: int, handler: HangDetectionKwargs | None, logging_dir: str | None
) -> HangWatchdog | None:
    """Start watching this rank (once per process group); returns the watchdog, or None when off.

    Off with one process, without a process group, with ``HangDetectionKwargs(enabled=False)`` or with
    ``LOCKSTEP_HANG_TIMEOUT=off``.
    """
    global _watchdog
    if world_size <= 1 or not dist.is_initialized():
        return None
    plan = resolve_plan(handler, _env.hang_timeout(), logging_dir)
    if _watchdog is not None and _watchdog.running and _watchdog.watches_current_group():
        if handler is None or plan == _watchdog.plan:
            return _watchdog  # a second Accelerator in the same run keeps the first one's watchdog
    if _watchdog is not None:
        _watchdog.stop()
    _watchdog = None
    if plan is None:
        return None
    _watchdog = HangWatchdog(
        plan,
        rank=rank,
        world_size=world_size,
        exchange=PeerExchange.for_default_group(),
        print_summary=not _env.launched_by_lockstep(),
    )
    _watchdog.start()
    _install_excepthook()
    return _watchdog


def note_step() -> None:
    """An optimizer step completed on this rank."""
    watchdog = _watchdog
    if watchdog is not None:
        watchdog.note_step()


@final
class _NoteStep:
    """Notes a step when entered (before the optimizer steps, so a step that hangs counts from its start)."""

    __slots__ = ()

    def __enter__(self) -> None:
        note_step()

    def __exit__(self, *exc_info: object) -> None:
        pass


@final
class StepProgress(StepHook):
    """The watchdog's step hook: every synchronising optimizer step of a prepared optimizer is progress."""

    _NOTE = _NoteStep()

    def around_optimizer_step(self, optimizer: object) -> _NoteStep:
        return self._NOTE


def stop() -> None:
    """Stop the watchdog (after the process group is torn down, or when training ends)."""
    global _watchdog
    if _watchdog is not None:
        _watchdog.stop()
    _watchdog = None


def current() -> HangWatchdog | None:
    return _watchdog if _watchdog is not None and _watchdog.running else None


def on_uncaught_exception(error: BaseException) -> None:
    """A collective timeout raised outside the recorded calls (e.g. in DDP's backward): diagnose it.

    Returns only when ``error`` is not a hang (the diagnosis ends the process otherwise).
    """
    watchdog = current()
    if watchdog is not None:
        watchdog.on_error(error)


def _install_excepthook() -> None:
    previous = sys.excepthook
    if getattr(previous, "_lockstep_hang", False):
        return

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        on_uncaught_exception(value)
        previous(kind, value, tb)

    hook._lockstep_hang = True  # type: ignore[attr-defined]
    sys.excepthook = hook
