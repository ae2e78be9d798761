"""Logging that knows about processes: log once, on every process, or on every process in rank order.

:func:`get_logger` wraps a standard :mod:`logging` logger in a :class:`MultiProcessAdapter`. Every
logging method (``debug``, ``info``, ``warning``, ...) takes two extra keyword arguments:

* ``main_process_only`` (default True): log on the main process only; False logs on every process.
* ``in_order`` (default False): with ``main_process_only=False``, log process by process in rank order,
  with a barrier between processes. Every process must make the call, or the others wait for it.

Records name the line that called the logger (``%(filename)s:%(lineno)d``), not this module, as
Accelerate's adapter does. An explicit ``stacklevel`` has Accelerate's meaning, which counts the logger's
own frame as 1: ``stacklevel=2`` (the default) is the line that called the logger, 3 its caller, and so on
(a wrapper that calls ``logger.log(..., stacklevel=3)`` names its own caller). Accelerate's
``stacklevel=1`` names a line inside the logger; here it names the calling line, like 2.

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


_OWN_FRAMES = 3
"""Frames of this module between a caller and :meth:`logging.Logger.log`: the public method, ``_log`` and
``_emit``."""


def _up(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with the caller's ``stacklevel`` (Accelerate's meaning: 2, the default, is the calling
    line, 3 its caller; values below 2 count as 2) turned into :mod:`logging`'s, past this module's frames."""
    kwargs["stacklevel"] = max(kwargs.get("stacklevel", 2) - 1, 1) + _OWN_FRAMES
    return kwargs


def _flags(kwargs: dict[str, Any]) -> tuple[bool, bool]:
    """``main_process_only`` and ``in_order``, taken out of ``kwargs``."""
    return kwargs.pop("main_process_only", True), kwargs.pop("in_order", False)


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

    Every logging method is defined here, so that only frames of this module lie between the caller and
    :meth:`logging.Logger.log`, each adding 1 to ``stacklevel``: :mod:`logging` counts the frames of its
    own methods (such as ``LoggerAdapter.info``) on Python 3.10 and skips them on 3.11+, so going through
    them would point one frame too far on one of the two.

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
            **kwargs: passed to :meth:`logging.Logger.log` (``exc_info``, ``extra``...); ``stacklevel``
                as Accelerate counts it (see the module docstring).

        Raises:
            RuntimeError: when no Accelerator or PartialState exists yet.
        """
        self._log(level, msg, args, main_process_only, in_order, _up(kwargs))

    def _log(
        self,
        level: int,
        msg: object,
        args: tuple[object, ...],
        main_process_only: bool,
        in_order: bool,
        kwargs: dict[str, Any],
    ) -> None:
        state = _require_state()
        if not self.isEnabledFor(level):
            return
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

    def debug(self, msg: object, *args: object, **kwargs: Any) -> None:
        """``log(logging.DEBUG, msg, *args, **kwargs)``."""
        self._log(logging.DEBUG, msg, args, *_flags(kwargs), _up(kwargs))

    def info(self, msg: object, *args: object, **kwargs: Any) -> None:
        """``log(logging.INFO, msg, *args, **kwargs)``."""
        self._log(logging.INFO, msg, args, *_flags(kwargs), _up(kwargs))

    def warning(self, msg: object, *args: object, **kwargs: Any) -> None:
        """``log(logging.WARNING, msg, *args, **kwargs)``."""
        self._log(logging.WARNING, msg, args, *_flags(kwargs), _up(kwargs))

    def error(self, msg: object, *args: object, **kwargs: Any) -> None:
        """``log(logging.ERROR, msg, *args, **kwargs)``."""
        self._log(logging.ERROR, msg, args, *_flags(kwargs), _up(kwargs))

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kwargs: Any) -> None:
        """``error()`` with the exception being handled (``exc_info=True``) appended to the record."""
        self._log(logging.ERROR, msg, args, *_flags(kwargs), _up({**kwargs, "exc_info": exc_info}))

    def critical(self, msg: object, *args: object, **kwargs: Any) -> None:
        """``log(logging.CRITICAL, msg, *args, **kwargs)``."""
        self._log(logging.CRITICAL, msg, args, *_flags(kwargs), _up(kwargs))

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
        self._log(logging.WARNING, msg, args, *_flags(kwargs), _up(kwargs))


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
