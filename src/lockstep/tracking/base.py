"""The interface every experiment tracker implements, and what a tracker needs to be built."""

from __future__ import annotations

import functools
import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class GeneralTracker(ABC):
    """Base of experiment trackers; subclass it for your own.

    ``init_trackers`` builds (or takes from ``log_with``) each tracker, then calls ``start()`` on every
    one, then ``store_init_configuration(config)``. Open files, runs and connections in ``start()`` rather
    than in ``__init__``: a tracker built before the process group exists then costs nothing, and one
    that does not run on this process (``main_process_only`` on the other ranks) never opens anything.
    A tracker that opens everything in ``__init__`` keeps working: ``start()`` does nothing by default.

    A subclass defines ``tracker``; ``log``, ``start``, ``store_init_configuration`` and ``finish`` do nothing
    unless it overrides them (as in Accelerate).

    Attributes:
        name: the name ``get_tracker`` finds it by.
        requires_logging_directory: whether it needs ``logging_dir`` (the project's logging folder). A class
            given to :func:`~lockstep.tracking.register_tracker_class` must set it itself.
        main_process_only: start and log on the main process only (the default; every built-in tracker
            does). False starts and logs it on every process.
        requires_packages: (lockstep) the modules it imports when it starts. ``log_with`` naming a
            registered tracker with one missing raises ``ImportError`` with ``install_command``, and
            ``log_with="all"`` leaves such a built-in tracker out.
        install_command: (lockstep) what installs ``requires_packages``, e.g. ``"pip install wandb"``.

    Example:
        >>> class PrintTracker(GeneralTracker):
        ...     name = "print"
        ...     requires_logging_directory = False
        ...     def __init__(self, path: str):
        ...         self.path = path
        ...     def start(self):
        ...         self.file = open(self.path, "a")
        ...     @property
        ...     def tracker(self):
        ...         return self.file
        ...     def log(self, values, step=None, **kwargs):
        ...         print(step, values, file=self.file)
        ...     def finish(self):
        ...         self.file.close()
        >>> # Accelerator(log_with=[PrintTracker("metrics.txt")])
    """

    name: str = ""
    requires_logging_directory: bool = False
    main_process_only: bool = True
    requires_packages: ClassVar[tuple[str, ...]] = ()
    install_command: ClassVar[str] = ""
    # lockstep's own file trackers read the logging folder when they start rather than when the
    # Accelerator is built (a script may set it in between); Accelerate's rule holds for every other one.
    _folder_checked_at_start: ClassVar[bool] = False

    @classmethod
    def missing_packages(cls) -> list[str]:
        """The modules of ``requires_packages`` that cannot be imported here."""
        return [package for package in cls.requires_packages if not importable(package)]

    @classmethod
    def is_available(cls) -> bool:
        """Whether it can start here: what ``log_with="all"`` and ``lockstep env`` ask of a tracker."""
        return not cls.missing_packages()

    def start(self) -> None:  # noqa: B027 (optional hook)
        """Open the tracker's resources (called once by ``init_trackers``, before the configuration)."""

    @property
    @abstractmethod
    def tracker(self) -> Any:
        """The underlying object (a SummaryWriter, a file, ...)."""

    def store_init_configuration(self, values: dict[str, Any]) -> None:  # noqa: B027 (optional hook)
        """Record the run's hyperparameters (called once by ``init_trackers``, after ``start``)."""

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:  # noqa: B027
        """Record ``values`` (metric name -> number, or text) at ``step``.

        Does nothing unless overridden: as in Accelerate, whose base class defines it, a tracker that only
        stores its configuration (or only starts a run) need not define ``log``.
        """

    def finish(self) -> None:  # noqa: B027 (optional hook)
        """Flush and close (called by ``end_training``)."""


def on_main_process(function: F) -> F:
    """Decorator for tracker methods: run only on the main process when the tracker is ``main_process_only``.

    The tracker's ``main_process_only`` is read at call time, so the process group is not touched when
    the tracker is built. Elsewhere the call does nothing and returns None. For trackers used on their
    own; trackers given to ``Accelerator(log_with=...)`` are already only started on the processes that
    log.

    Example:
        >>> class RankZeroTracker(GeneralTracker):
        ...     name = "rank0"
        ...     @property
        ...     def tracker(self):
        ...         return None
        ...     @on_main_process
        ...     def log(self, values, step=None, **kwargs):
        ...         print(step, values)
    """

    @functools.wraps(function)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "main_process_only", False):
            from lockstep.state import PartialState

            if not PartialState().is_main_process:
                return None
        return function(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def importable(module: str) -> bool:
    """Whether ``module`` can be found, without importing it (False when it is blocked in ``sys.modules``)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that fails to import, or a broken __spec__
        return False


def plain_value(value: Any) -> Any:
    """A JSON/CSV-friendly number or string for ``value`` (0-dim tensors and numpy scalars become floats)."""
    if hasattr(value, "item") and callable(value.item):
        try:
            return value.item()
        except (ValueError, RuntimeError):
            pass
    return value


def not_started(tracker: GeneralTracker) -> RuntimeError:
    """The error a built-in tracker raises when used before ``start()``."""
    return RuntimeError(
        f"The {tracker.name} tracker was used before it was started: call tracker.start() first "
        "(Accelerator.init_trackers does this for the trackers given as log_with)."
    )
