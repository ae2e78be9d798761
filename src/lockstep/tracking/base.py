"""The interface every experiment tracker implements, and what a tracker needs to be built."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class GeneralTracker(ABC):
    """Base of experiment trackers; subclass it for your own.

    Attributes:
        name: the name ``get_tracker`` finds it by.
        requires_logging_directory: whether it needs ``logging_dir`` (the project's logging folder).
        main_process_only: log on the main process only (the default; every built-in tracker does).

    Example:
        >>> class PrintTracker(GeneralTracker):
        ...     name = "print"
        ...     requires_logging_directory = False
        ...     def __init__(self, run_name: str):
        ...         self.run_name = run_name
        ...     @property
        ...     def tracker(self):
        ...         return None
        ...     def log(self, values, step=None, **kwargs):
        ...         print(step, values)
        >>> # Accelerator(log_with=[PrintTracker("run")])
    """

    name: str = ""
    requires_logging_directory: bool = False
    main_process_only: bool = True

    @property
    @abstractmethod
    def tracker(self) -> Any:
        """The underlying object (a SummaryWriter, a file, ...)."""

    def store_init_configuration(self, values: dict[str, Any]) -> None:  # noqa: B027 (optional hook)
        """Record the run's hyperparameters (called once by ``init_trackers``)."""

    @abstractmethod
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Record ``values`` (metric name -> number, or text) at ``step``."""

    def finish(self) -> None:  # noqa: B027 (optional hook)
        """Flush and close (called by ``end_training``)."""


def plain_value(value: Any) -> Any:
    """A JSON/CSV-friendly number or string for ``value`` (0-dim tensors and numpy scalars become floats)."""
    if hasattr(value, "item") and callable(value.item):
        try:
            return value.item()
        except (ValueError, RuntimeError):
            pass
    return value
