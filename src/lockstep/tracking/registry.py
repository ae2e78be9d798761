"""The one place that turns ``log_with`` into trackers: the name table, the checks, the building.

As in Accelerate, ``Accelerator(log_with=...)`` goes through :func:`filter_trackers` (names checked,
repeats dropped, ``"all"`` expanded, a missing logging folder refused), and ``init_trackers`` looks each
name up in :data:`LOGGER_TYPE_TO_CLASS` when it builds the trackers, then starts them.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lockstep.config.enums import LoggerType
from lockstep.tracking.base import GeneralTracker
from lockstep.tracking.files import CSVTracker, JSONLTracker
from lockstep.tracking.mlflow import MLflowTracker
from lockstep.tracking.tensorboard import TensorBoardTracker
from lockstep.tracking.wandb import WandBTracker

LOGGER_TYPE_TO_CLASS: dict[str, type[GeneralTracker]] = {
    "jsonl": JSONLTracker,
    "csv": CSVTracker,
    "tensorboard": TensorBoardTracker,
    "mlflow": MLflowTracker,
    "wandb": WandBTracker,
}
"""``log_with`` name -> tracker class, read when ``init_trackers`` builds the trackers.

Replace an entry to use your own class under a built-in name, or add one to give your class a name
``log_with`` accepts. The class is called ``cls(project_name, logging_dir, **init_kwargs[name])`` when it
``requires_logging_directory``, else ``cls(project_name, **init_kwargs[name])`` (with ``logging_dir=``
too when its ``__init__`` has that parameter, as lockstep's MLflow and wandb trackers do).
"""


@dataclass(frozen=True)
class _Package:
    """What a built-in tracker needs installed: ``package`` to use it, ``extras`` too for ``"all"``."""

    package: str
    install: str
    extras: tuple[str, ...] = ()


_PACKAGES = {
    "tensorboard": _Package("tensorboard", "pip install tensorboard"),
    # The local SQLite store needs sqlalchemy and alembic; a remote tracking_uri does not.
    "mlflow": _Package("mlflow", "pip install mlflow-skinny sqlalchemy alembic", ("sqlalchemy", "alembic")),
    "wandb": _Package("wandb", "pip install wandb"),
}
# Accelerate's trackers that lockstep does not include.
_NOT_INCLUDED = ("aim", "clearml", "comet_ml", "dvclive", "swanlab", "trackio")
# lockstep's own file trackers take the logging folder as it is at init_trackers (a script may set it
# after building the Accelerator); Accelerate's rule, the folder known at construction, holds for the rest.
_FOLDER_CHECKED_AT_START = ("jsonl", "csv")


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def get_available_trackers() -> list[LoggerType]:
    """The built-in trackers whose packages are installed: what ``log_with="all"`` means here."""
    kinds = [LoggerType.JSONL, LoggerType.CSV]
    for name, needs in _PACKAGES.items():
        if all(_installed(package) for package in (needs.package, *needs.extras)):
            kinds.append(LoggerType(name))
    return kinds


def filter_trackers(
    log_with: Any, logging_dir: str | os.PathLike | None = None
) -> list[str | GeneralTracker]:
    """Check ``log_with`` and return its trackers: names (``LoggerType`` members) and tracker objects.

    Repeated names are dropped; ``"all"`` becomes every built-in tracker whose package is installed;
    tracker objects are kept as they are. Unlike Accelerate, which skips a named tracker whose package
    is missing, lockstep raises ``ImportError`` with the ``pip install`` line.

    Args:
        log_with: a name (``"jsonl"``, ``"tensorboard"``, ``LoggerType.WANDB``, ``"all"``, or a name added
            to ``LOGGER_TYPE_TO_CLASS``), a ``GeneralTracker`` instance, or a list of them.
        logging_dir: the project's logging folder. A named tracker that writes files (TensorBoard) needs
            one, as in Accelerate.

    Example:
        >>> filter_trackers(["jsonl", "csv", "jsonl"], logging_dir="runs")
        [<LoggerType.JSONL: 'jsonl'>, <LoggerType.CSV: 'csv'>]
    """
    if log_with is None:
        return []
    items: Sequence[Any] = log_with if isinstance(log_with, (list, tuple)) else [log_with]
    found: list[str | GeneralTracker] = []
    for item in items:
        if isinstance(item, GeneralTracker):
            found.append(item)
            continue
        kind = _name(item)
        if kind == LoggerType.ALL:
            found += [k for k in get_available_trackers() if k not in found]
        elif kind not in found:
            _check_usable(kind, logging_dir)
            found.append(kind)
    return found


def _name(item: Any) -> str:
    """The table name of one ``log_with`` entry (a ``LoggerType`` member for the built-in names)."""
    if isinstance(item, type) and issubclass(item, GeneralTracker):
        raise TypeError(
            f"log_with={item.__name__} is a tracker class: pass an instance, log_with={item.__name__}(...), "
            "or register the class by name in lockstep.tracking.LOGGER_TYPE_TO_CLASS."
        )
    if isinstance(item, str) and not isinstance(item, LoggerType) and item in LOGGER_TYPE_TO_CLASS:
        try:
            return LoggerType(item)
        except ValueError:
            return item  # a name the user added to the table
    try:
        return LoggerType.parse(item, argument="log_with")
    except ValueError:
        pass
    choices = ", ".join(repr(name) for name in ("all", *LOGGER_TYPE_TO_CLASS))
    if str(item).strip().lower() in _NOT_INCLUDED:
        raise ValueError(
            f"log_with={item!r} is an Accelerate tracker that lockstep does not include: write a "
            f"GeneralTracker for it and pass an instance, or use one of {choices}."
        )
    raise ValueError(
        f"log_with={item!r} is invalid: it must be one of {choices}, or a GeneralTracker instance."
    )


def _check_usable(name: str, logging_dir: str | os.PathLike | None) -> None:
    """Refuse a named tracker whose package is missing, or that writes files with no folder to write to."""
    name = str(name)
    needs = _PACKAGES.get(name)
    if needs is not None and not _installed(needs.package):
        raise ImportError(f"log_with='{name}' needs the {needs.package} package: {needs.install}")
    tracker_class = LOGGER_TYPE_TO_CLASS.get(name)
    needs_folder = tracker_class is not None and tracker_class.requires_logging_directory
    if needs_folder and logging_dir is None and name not in _FOLDER_CHECKED_AT_START:
        raise missing_logging_dir(name)


def missing_logging_dir(name: str) -> ValueError:
    """Accelerate's error for a tracker that writes files with no logging folder, with what to do."""
    name = str(name)
    return ValueError(
        f"Logging with `{name}` requires a `logging_dir` to be passed in: log_with={name!r} writes files "
        "under logging_dir/project_name and no folder is set. Pass Accelerator(project_dir=...) or "
        "Accelerator(project_config=ProjectConfiguration(logging_dir=...))."
    )


def spec_name(spec: str | GeneralTracker) -> str:
    """The name ``get_tracker`` finds a ``filter_trackers`` entry by."""
    return spec.name if isinstance(spec, GeneralTracker) else str(spec)


def build_trackers(
    specs: Sequence[str | GeneralTracker],
    project_name: str,
    *,
    logging_dir: str | None,
    init_kwargs: dict[str, dict[str, Any]] | None,
    is_main_process: bool,
) -> list[GeneralTracker]:
    """The trackers this process runs, built but not started (``main_process_only`` ones: main only).

    Names are looked up in ``LOGGER_TYPE_TO_CLASS`` now, so a class registered after the Accelerator
    was built is used.
    """
    trackers: list[GeneralTracker] = []
    for spec in specs:
        if isinstance(spec, GeneralTracker):
            if is_main_process or not spec.main_process_only:
                trackers.append(spec)
            continue
        name = str(spec)
        tracker_class = LOGGER_TYPE_TO_CLASS.get(name)
        if tracker_class is None:
            raise ValueError(
                f"log_with={name!r}: no tracker class is registered under that name in "
                "lockstep.tracking.LOGGER_TYPE_TO_CLASS any more. Put one back before init_trackers."
            )
        if is_main_process or not tracker_class.main_process_only:
            kwargs = dict((init_kwargs or {}).get(name, {}))
            trackers.append(_build(tracker_class, name, project_name, logging_dir, kwargs))
    return trackers


def _build(
    tracker_class: type[GeneralTracker],
    name: str,
    project_name: str,
    logging_dir: str | None,
    kwargs: dict[str, Any],
) -> GeneralTracker:
    if tracker_class.requires_logging_directory:
        if logging_dir is None:
            raise missing_logging_dir(name)
        return tracker_class(project_name, logging_dir, **kwargs)  # type: ignore[call-arg]
    if "logging_dir" in inspect.signature(tracker_class).parameters:
        kwargs.setdefault("logging_dir", logging_dir)
    return tracker_class(project_name, **kwargs)  # type: ignore[call-arg]


class DisabledTracker(GeneralTracker):
    """What ``get_tracker`` returns on processes that do not log: every call does nothing."""

    def __init__(self, name: str) -> None:
        self.name = name

    @property
    def tracker(self) -> Any:
        return None

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        return None
