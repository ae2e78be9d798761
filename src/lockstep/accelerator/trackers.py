"""The Accelerator's experiment trackers: started on the processes that log, fed by ``log``.

Which trackers exist and how they are built is :mod:`lockstep.tracking.registry`'s business; this object
holds the ones an Accelerator was configured with and started.
"""

from __future__ import annotations

from typing import Any

from lockstep.config.project import ProjectConfiguration
from lockstep.tracking.base import GeneralTracker
from lockstep.tracking.files import EVENT_KEY
from lockstep.tracking.registry import DisabledTracker, build_trackers, filter_trackers, spec_name


class Trackers:
    """The trackers of one Accelerator.

    Args:
        log_with: the Accelerator's ``log_with`` (names, ``"all"``, tracker objects or a list of them),
            checked as Accelerate's ``filter_trackers`` does against the logging folder known now.
        project: the run's folders; file-based trackers write under its ``logging_dir`` as it is when they
            start (a script may set the folders after building the Accelerator).
        is_main_process: whether this process logs (trackers may also log on every process).
    """

    def __init__(self, log_with: Any, *, project: ProjectConfiguration, is_main_process: bool) -> None:
        self.specs = filter_trackers(log_with, project.logging_dir)
        self.project = project
        self.is_main_process = is_main_process
        self.started: list[GeneralTracker] = []
        self.pending_events: list[tuple[str, int | None]] = []

    @property
    def names(self) -> list[str]:
        """The names of the configured trackers, in ``log_with`` order."""
        return [spec_name(spec) for spec in self.specs]

    @property
    def active(self) -> bool:
        """Whether any tracker was started on this process."""
        return bool(self.started)

    def start(self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None) -> None:
        """Build the trackers this process runs, call ``start()`` on each, then record ``config`` in each.

        As in Accelerate: every tracker is built (or taken from ``log_with``) first, then started, then
        given the configuration. Trackers that do not run on this process are neither built nor started.
        """
        trackers = build_trackers(
            self.specs,
            project_name,
            logging_dir=self.project.logging_dir,
            init_kwargs=init_kwargs,
            is_main_process=self.is_main_process,
        )
        self.started = []
        for tracker in trackers:
            tracker.start()
            self.started.append(tracker)  # one by one: end_training closes those that did start
        if config is not None:
            for tracker in self.started:
                tracker.store_init_configuration(config)
        pending, self.pending_events = self.pending_events, []
        for text, step in pending:
            self.record_event(text, step)

    def record_event(self, text: str, step: int | None = None) -> None:
        """Write a text event (a restart on another number of processes) into the trackers that keep
        text lines (``jsonl``, which ``lockstep report`` reads); held until ``start`` when none started yet
        (a script may load its checkpoint before ``init_trackers``)."""
        if not self.started:
            self.pending_events.append((text, step))
            return
        for tracker in self.started:
            if tracker.name == "jsonl":
                tracker.log({EVENT_KEY: text}, step=step)

    def log(self, values: dict, step: int | None = None, log_kwargs: dict | None = None) -> None:
        """Send ``values`` to every started tracker (nothing happens where none was started)."""
        for tracker in self.started:
            tracker.log(values, step=step, **(log_kwargs or {}).get(tracker.name, {}))

    def get(self, name: str, unwrap: bool = False) -> Any:
        """``Accelerator.get_tracker``: the tracker called ``name``, or a do-nothing stand-in (see there)."""
        for tracker in self.started:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        if name in self.names:
            stand_in = DisabledTracker(name)
            return stand_in.tracker if unwrap else stand_in
        configured = self.names or "none"
        raise ValueError(
            f"get_tracker({name!r}): no such tracker was configured with log_with (configured: {configured})."
        )

    def finish(self) -> None:
        """Close every started tracker."""
        for tracker in self.started:
            tracker.finish()
        self.started = []
