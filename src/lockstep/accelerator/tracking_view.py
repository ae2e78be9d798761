"""The Accelerator's experiment-tracker members (Accelerate's names), over its :class:`Trackers`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lockstep.accelerator.trackers import Trackers
    from lockstep.tracking.base import GeneralTracker


class TrackingView:
    """``init_trackers``, ``log``, ``get_tracker``, ``trackers`` and ``log_with`` of an Accelerator.

    Args:
        trackers: the trackers the Accelerator was given (``log_with``).
    """

    def __init__(self, trackers: Trackers) -> None:
        self._trackers = trackers

    def init_trackers(
        self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None
    ) -> None:
        """``Accelerator.init_trackers``: start the trackers of ``log_with`` (see there)."""
        self._trackers.start(project_name, config=config, init_kwargs=init_kwargs)

    @property
    def log_with(self) -> list[Any]:
        """The trackers ``log_with`` asked for, checked (names and tracker objects), before ``init_trackers``."""
        return list(self._trackers.specs)

    @property
    def trackers(self) -> list[GeneralTracker]:
        """The trackers started on this process (empty on processes that do not log)."""
        return self._trackers.started

    @trackers.setter
    def trackers(self, trackers: list[GeneralTracker]) -> None:
        self._trackers.started = trackers

    def log(self, values: dict, step: int | None = None, log_kwargs: dict | None = None) -> None:
        """Send ``values`` to every started tracker (a no-op on processes that do not log)."""
        self._trackers.log(values, step=step, log_kwargs=log_kwargs)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """``Accelerator.get_tracker``: the tracker called ``name``, or a do-nothing stand-in (see there)."""
        return self._trackers.get(name, unwrap=unwrap)
