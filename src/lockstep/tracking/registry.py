"""The one place that turns ``log_with`` into trackers: the table of registered trackers, the checks, the building.

Every tracker ``log_with`` accepts by name is a row of :data:`LOGGER_TYPE_TO_CLASS`, put there by
:func:`register_tracker_class`: lockstep's own (the classes named in ``BUILT_IN_TRACKERS``, registered when
this module is imported) and yours alike. A row is the class, and the class says the rest: its
``requires_logging_directory``, the packages it needs (``requires_packages``, ``install_command``) and
whether it can start here (``is_available()``). As in Accelerate, ``Accelerator(log_with=...)`` goes
through :func:`filter_trackers` (names checked, repeats dropped, ``"all"`` expanded, a missing logging
folder refused), and ``init_trackers`` looks each name up in the table when it builds the trackers.
"""

from __future__ import annotations

import importlib
import inspect
import os
import warnings
from collections.abc import Sequence
from typing import Any

from lockstep.config.enums import BUILT_IN_TRACKERS, LoggerType
from lockstep.errors import NotATrackerClassError
from lockstep.tracking.base import GeneralTracker

LOGGER_TYPE_TO_CLASS: dict[str, type[GeneralTracker]] = {}
"""``log_with`` name -> tracker class, read when ``init_trackers`` builds the trackers.

Add to it with :func:`register_tracker_class`. The class is called
``cls(project_name, logging_dir, **init_kwargs[name])`` when it ``requires_logging_directory``, else
``cls(project_name, **init_kwargs[name])`` (with ``logging_dir=`` too when its ``__init__`` has that
parameter, as lockstep's MLflow and wandb trackers do).
"""

ENTRY_POINT_GROUP = "lockstep.trackers"
"""The entry-point group an installed package registers its trackers under: each entry point names a
``GeneralTracker`` subclass, registered as :func:`register_tracker_class` would, on the first look-up of a
tracker name."""
_installed: set[str] = set()
"""The entry points registered so far (``module:attribute``), each registered once."""

# Accelerate's trackers that lockstep does not include.
_NOT_INCLUDED = ("aim", "clearml", "comet_ml", "dvclive", "swanlab", "trackio")


def register_tracker_class(tracker_class: type[GeneralTracker]) -> None:
    """Accept ``tracker_class`` by its ``name`` in ``Accelerator(log_with=...)`` and
    ``TrainingArguments(report_to=...)``, as the built-in trackers are (Accelerate 1.15's function).

    Register it before building the Accelerator (or the TrainingArguments) that names it. A name already
    registered is replaced, with a ``UserWarning``: that is how a built-in tracker is swapped for your class.
    ``init_trackers`` builds the class as :data:`LOGGER_TYPE_TO_CLASS` says; when it
    ``requires_logging_directory``, naming it without a logging folder is a ``ValueError`` when the
    Accelerator is built.

    Args:
        tracker_class: a subclass of :class:`~lockstep.tracking.GeneralTracker` with a non-empty ``name``.

    Raises:
        TypeError: ``tracker_class`` is not a ``GeneralTracker`` subclass (the error is a ``ValueError``
            too, which is what Accelerate raises).
        ValueError: its ``name`` is empty, not text, or ``"all"``; or it does not set
            ``requires_logging_directory`` itself (the base class's default does not count, as in Accelerate).

    Example:
        >>> class PrintTracker(GeneralTracker):
        ...     name = "print"
        ...     requires_logging_directory = False
        ...     def __init__(self, run_name, **kwargs):
        ...         self.run_name = run_name
        ...     @property
        ...     def tracker(self):
        ...         return None
        ...     def log(self, values, step=None, **kwargs):
        ...         print(step, values)
        >>> register_tracker_class(PrintTracker)
        >>> # Accelerator(log_with="print") or TrainingArguments(..., report_to="print")
        >>> del LOGGER_TYPE_TO_CLASS["print"]  # what a test does to leave the table as it was
    """
    if not (isinstance(tracker_class, type) and issubclass(tracker_class, GeneralTracker)):
        shown = getattr(tracker_class, "__name__", None) or repr(tracker_class)
        raise NotATrackerClassError(
            f"register_tracker_class({shown}) is invalid: it takes a subclass of "
            "lockstep.tracking.GeneralTracker (the class, not an instance). Subclass GeneralTracker, set its "
            "name, and register the class."
        )
    name = tracker_class.name
    if not isinstance(name, str) or not name or name == LoggerType.ALL:
        raise ValueError(
            f"register_tracker_class({tracker_class.__name__}) is invalid: its name is {name!r}, and log_with "
            "finds a tracker by its name. Set the class attribute name to a non-empty string other than 'all'."
        )
    if not _sets_logging_flag(tracker_class):
        raise ValueError(
            f"register_tracker_class({tracker_class.__name__}) is invalid: it does not set "
            "requires_logging_directory, which tells log_with whether to build it with the logging folder. "
            "Set the class attribute requires_logging_directory = True if the tracker needs a logging "
            "directory, or False otherwise."
        )
    if name in LOGGER_TYPE_TO_CLASS:
        replaced = LOGGER_TYPE_TO_CLASS[name]
        warnings.warn(
            f"A tracker with the name '{name}' is already registered ({_path(replaced)}) and is overwritten "
            f"by {_path(tracker_class)}: log_with={name!r} now builds the new class.",
            UserWarning,
            stacklevel=2,
        )
    LOGGER_TYPE_TO_CLASS[name] = tracker_class


def _sets_logging_flag(tracker_class: type[GeneralTracker]) -> bool:
    """Whether ``tracker_class`` (or a base of it other than ``GeneralTracker``) sets
    ``requires_logging_directory``: Accelerate's base class has no default for it."""
    return any(
        "requires_logging_directory" in vars(cls)
        for cls in tracker_class.__mro__
        if cls is not GeneralTracker
    )


def _path(tracker_class: type) -> str:
    return f"{tracker_class.__module__}.{tracker_class.__qualname__}"


def _register_built_in_trackers() -> None:
    """Register the classes of ``BUILT_IN_TRACKERS``, through the public call."""
    for name, location in BUILT_IN_TRACKERS.items():
        module, _, attribute = location.partition(":")
        tracker_class = getattr(importlib.import_module(module), attribute)
        assert tracker_class.name == name, f"BUILT_IN_TRACKERS[{name!r}] is {tracker_class.name!r}"
        register_tracker_class(tracker_class)


def registered_trackers() -> dict[str, type[GeneralTracker]]:
    """:data:`LOGGER_TYPE_TO_CLASS` once the trackers of installed packages (the ``lockstep.trackers``
    entry-point group) are in it.

    Example:
        >>> registered_trackers()["jsonl"].__name__
        'JSONLTracker'
    """
    from lockstep.entry_points import installed_entry_points

    for entry in installed_entry_points(ENTRY_POINT_GROUP):
        if entry.value in _installed:
            continue
        _installed.add(entry.value)
        try:
            register_tracker_class(entry.load())
        except Exception as error:  # an installed package's fault must not stop the trackers of the run
            warnings.warn(
                f"The tracker {entry.name!r} an installed package declares ({ENTRY_POINT_GROUP} entry point "
                f"{entry.value}) is not registered: {type(error).__name__}: {error}",
                UserWarning,
                stacklevel=2,
            )
    return LOGGER_TYPE_TO_CLASS


def find_tracker_name(text: str) -> str | None:
    """The registered name ``text`` stands for (``"all"`` included), case aside; None when there is none.

    Example:
        >>> find_tracker_name("TensorBoard"), find_tracker_name("neptune")
        ('tensorboard', None)
    """
    if text in registered_trackers() or text == LoggerType.ALL:
        return str(text)
    folded = text.strip().lower()
    matches = [name for name in ("all", *LOGGER_TYPE_TO_CLASS) if name.lower() == folded]
    return matches[0] if len(matches) == 1 else None


def tracker_choices() -> tuple[str, ...]:
    """Every name ``log_with`` and ``report_to`` accept now: ``"all"``, then the registered trackers."""
    return ("all", *registered_trackers())


def get_available_trackers() -> list[LoggerType]:
    """The built-in trackers that can start here (their packages are installed): what ``log_with="all"``
    means, as in Accelerate (trackers you register are named to be used, never implied by ``"all"``)."""
    return [
        LoggerType(name)
        for name in BUILT_IN_TRACKERS
        if name in LOGGER_TYPE_TO_CLASS and LOGGER_TYPE_TO_CLASS[name].is_available()
    ]


def filter_trackers(
    log_with: Any, logging_dir: str | os.PathLike | None = None
) -> list[str | GeneralTracker]:
    """Check ``log_with`` and return its trackers: registered names and tracker objects.

    Repeated names are dropped; ``"all"`` becomes every built-in tracker whose package is installed;
    tracker objects are kept as they are. Unlike Accelerate, which skips a named tracker whose package
    is missing, lockstep raises ``ImportError`` with the ``pip install`` line.

    Args:
        log_with: a name (``"jsonl"``, ``"tensorboard"``, ``LoggerType.WANDB``, ``"all"``, or the name of a
            class given to :func:`register_tracker_class`), a ``GeneralTracker`` instance, or a list of them.
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
            f"or register the class, lockstep.tracking.register_tracker_class({item.__name__}), and pass "
            "its name."
        )
    name = find_tracker_name(item) if isinstance(item, str) else None
    if name is not None:
        return LoggerType(name) if name in BUILT_IN_TRACKERS else name
    choices = ", ".join(repr(choice) for choice in tracker_choices())
    if str(item).strip().lower() in _NOT_INCLUDED:
        raise ValueError(
            f"log_with={item!r} is an Accelerate tracker that lockstep does not include: write a "
            f"GeneralTracker for it and pass an instance, or use one of {choices}."
        )
    raise ValueError(
        f"log_with={item!r} is invalid: it must be one of {choices}, or a GeneralTracker instance. "
        "A tracker class of your own is accepted by name once lockstep.tracking.register_tracker_class "
        "has registered it."
    )


def _check_usable(name: str, logging_dir: str | os.PathLike | None) -> None:
    """Refuse a named tracker whose package is missing, or that writes files with no folder to write to."""
    name = str(name)
    tracker_class = LOGGER_TYPE_TO_CLASS[name]
    missing = tracker_class.missing_packages()
    if missing:
        install = tracker_class.install_command or f"pip install {' '.join(missing)}"
        raise ImportError(f"log_with='{name}' needs the {' and '.join(missing)} package: {install}")
    folder_checked_now = not tracker_class._folder_checked_at_start
    if tracker_class.requires_logging_directory and logging_dir is None and folder_checked_now:
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
                "lockstep.tracking.LOGGER_TYPE_TO_CLASS any more. Register one with "
                "lockstep.tracking.register_tracker_class before init_trackers."
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


_register_built_in_trackers()
