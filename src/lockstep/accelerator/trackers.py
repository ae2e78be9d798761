"""The Accelerator's experiment trackers: ``init_trackers``, ``log``, ``get_tracker``.

A base class of :class:`lockstep.Accelerator`; which trackers exist and how they are built is
:mod:`lockstep.tracking.registry`'s business.
"""

from __future__ import annotations

from typing import Any

from lockstep.tracking.base import GeneralTracker
from lockstep.tracking.registry import DisabledTracker, build_trackers


class Tracking:
    """Trackers started on the processes that log (the main process, unless a tracker says otherwise)."""

    trackers: list[GeneralTracker]
    _tracker_specs: list[Any]
    logging_dir: str | None
    is_main_process: bool

    # -- trackers ---------------------------------------------------------------------------------
    def init_trackers(
        self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None
    ) -> None:
        """Start the trackers given as ``log_with`` (on the main process) and record ``config``.

        Example:
            >>> accelerator = Accelerator(log_with="jsonl", project_dir="runs/a")  # doctest: +SKIP
            >>> accelerator.init_trackers("sentiment", config={"lr": 3e-5})  # doctest: +SKIP
            >>> accelerator.log({"loss": 0.5}, step=1)  # doctest: +SKIP
        """
        self.trackers = build_trackers(
            self._tracker_specs,
            project_name,
            logging_dir=self.logging_dir,
            init_kwargs=init_kwargs,
            is_main_process=self.is_main_process,
        )
        if config is not None:
            for tracker in self.trackers:
                tracker.store_init_configuration(config)

    def log(self, values: dict, step: int | None = None, log_kwargs: dict | None = None) -> None:
        """Send ``values`` to every started tracker (a no-op on processes that do not log)."""
        for tracker in self.trackers:
            tracker.log(values, step=step, **(log_kwargs or {}).get(tracker.name, {}))

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The tracker called ``name`` (its underlying object with ``unwrap``); a do-nothing stand-in on
        processes that do not log."""
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        if any(spec.name == name for spec in self._tracker_specs):
            stand_in = DisabledTracker(name)
            return stand_in.tracker if unwrap else stand_in
        configured = [spec.name for spec in self._tracker_specs] or "none"
        raise ValueError(
            f"get_tracker({name!r}): no such tracker was configured with log_with (configured: {configured})."
        )

    def _finish_trackers(self) -> None:
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
