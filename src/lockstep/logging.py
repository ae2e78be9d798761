"""Logging that knows about processes: log once, on every process, or on every process in rank order.

:func:`get_logger` wraps a standard :mod:`logging` logger in a :class:`MultiProcessAdapter`. Every
logging method (``debug``, ``info``, ``warning``, ...) takes two extra keyword arguments:

* ``main_process_only`` (default True): log on the main process only; False logs on every process.
* ``in_order`` (default False): with ``main_process_only=False``, log process by process in rank order,
  with a barrier between processes. Every process must make the call, or the others wait for it.

Example:
    >>> from lockstep import PartialState
    >>> from lockstep.logging import get_logger
    >>> state = PartialState()  # (or the Accelerator) first: the logger asks it which process is the main one
    >>> logger = get_logger(__name__, log_level="INFO")
    >>> logger.info("loaded the data set")  # main process only
    >>> logger.info("my shard is ready", main_process_only=False, in_order=True)  # rank 0, then 1, ...
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

from lockstep import _env
from lockstep.state import PartialState

LOG_LEVEL_ENV = _env.LOCKSTEP_LOG_LEVEL
"""Environment variable read by :func:`get_logger` when ``log_level`` is not given."""

# (logger name, level, message, args) already emitted by warning_once, across adapters.
_warned_once: set[tuple[str, str, str]] = set()


def _require_state() -> PartialState:
    if PartialState._context is None:
        raise RuntimeError(
            "lockstep's logger was used before the process state exists: it needs to know which process "
            "is the main one. Create the Accelerator() or PartialState() first, then log."
        )
    return PartialState()


class MultiProcessAdapter(logging.LoggerAdapter):
    """A logger adapter that logs on the main process only, on every process, or in rank order.

    Create it with :func:`get_logger`. An Accelerator or PartialState must exist before the first call.

    Example:
        >>> from lockstep import PartialState
        >>> state = PartialState()
        >>> logger = get_logger(__name__)
        >>> logger.warning("loss is NaN on this rank", main_process_only=False)
    """

    def log(  # type: ignore[override]
        self,
        level: int,
        msg: object,
        *args: object,
        main_process_only: bool = True,
        in_order: bool = False,
        **kwargs: Any,
    ) -> None:
        """Log ``msg`` % ``args`` at ``level`` on the processes chosen by the two keyword flags.

        Args:
            level: a :mod:`logging` level such as ``logging.INFO``.
            msg: the message, formatted with ``args`` as :mod:`logging` does.
            *args: the message arguments.
            main_process_only: log on the main process only.
            in_order: with ``main_process_only=False``, log in rank order with barriers in between.
                Ignored (no barriers) when only the main process logs.
            **kwargs: passed to :meth:`logging.Logger.log` (``exc_info``, ``stacklevel``, ``extra``...).

        Raises:
            RuntimeError: when no Accelerator or PartialState exists yet.
        """
        state = _require_state()
        if not self.isEnabledFor(level):
            return
        # stacklevel 1 means the caller of log(); two of our frames (log, _emit) lie in between.
        kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 2
        if main_process_only:
            if state.is_main_process:
                self._emit(level, msg, args, kwargs)
        elif not in_order:
            self._emit(level, msg, args, kwargs)
        else:
            for rank in range(state.num_processes):
                if rank == state.process_index:
                    self._emit(level, msg, args, kwargs)
                state.wait_for_everyone()

    def _emit(
        self, level: int, msg: object, args: tuple[object, ...], kwargs: MutableMapping[str, Any]
    ) -> None:
        msg, kwargs = self.process(msg, kwargs)
        self.logger.log(level, msg, *args, **kwargs)

    def warning_once(self, msg: object, *args: object, **kwargs: Any) -> None:
        """``warning()``, but a given message (with its arguments) is emitted only once per process.

        Example:
            >>> from lockstep import PartialState
            >>> state = PartialState()
            >>> get_logger(__name__).warning_once("gradient checkpointing is off")
        """
        key = (self.logger.name, str(msg), repr(args))
        if key in _warned_once:
            return
        _warned_once.add(key)
        kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 1
        self.warning(msg, *args, **kwargs)


def _level(log_level: str | int, source: str) -> int | str:
    level = log_level.upper() if isinstance(log_level, str) else log_level
    if isinstance(level, str) and not isinstance(logging.getLevelName(level), int):
        raise ValueError(
            f"{source}={log_level!r} is not a logging level: use DEBUG, INFO, WARNING, ERROR or CRITICAL."
        )
    return level


def get_logger(name: str, log_level: str | int | None = None) -> MultiProcessAdapter:
    """A process-aware logger for ``name`` (usually ``__name__``).

    Args:
        name: the name of the :mod:`logging` logger to wrap.
        log_level: a level such as ``"INFO"`` set on that logger and on the root logger (as Accelerate
            does); when None, the ``LOCKSTEP_LOG_LEVEL`` environment variable, else left unchanged.

    Returns:
        A :class:`MultiProcessAdapter`; log with it after creating the Accelerator or PartialState.

    Raises:
        ValueError: when the level is not a logging level name.

    Example:
        >>> from lockstep import PartialState
        >>> state = PartialState()
        >>> logger = get_logger(__name__, log_level="INFO")
        >>> logger.info("epoch %d done", 3)  # main process only
    """
    source = "get_logger(log_level)"
    if log_level is None:
        log_level, source = _env.log_level(), LOG_LEVEL_ENV
    logger = logging.getLogger(name)
    if log_level is not None:
        level = _level(log_level, source)
        logger.setLevel(level)
        logging.getLogger().setLevel(level)
    return MultiProcessAdapter(logger, {})


__all__ = ["LOG_LEVEL_ENV", "MultiProcessAdapter", "get_logger"]
