"""The one place that turns ``log_with`` into tracker classes."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

from lockstep.config.enums import LoggerType
from lockstep.tracking.base import GeneralTracker
from lockstep.tracking.files import CSVTracker, JSONLTracker

_NOT_BUILT = {LoggerType.MLFLOW: "mlflow", LoggerType.WANDB: "wandb"}


def _tensorboard() -> type[GeneralTracker]:
    from lockstep.tracking.tensorboard import TensorBoardTracker

    return TensorBoardTracker


def tracker_class(kind: LoggerType) -> type[GeneralTracker]:
    if kind in _NOT_BUILT:
        raise NotImplementedError(
            f"log_with='{kind.value}' is not supported yet: the {_NOT_BUILT[kind]} tracker is not part of this "
            "version of lockstep. Use 'jsonl', 'csv' or 'tensorboard', or subclass GeneralTracker."
        )
    if kind == LoggerType.TENSORBOARD:
        if importlib.util.find_spec("tensorboard") is None:
            raise ImportError("log_with='tensorboard' needs the tensorboard package: pip install tensorboard")
        return _tensorboard()
    return {LoggerType.JSONL: JSONLTracker, LoggerType.CSV: CSVTracker}[kind]


def available_kinds() -> list[LoggerType]:
    """What ``log_with="all"`` means here: the built-in trackers whose packages are installed."""
    kinds = [LoggerType.JSONL, LoggerType.CSV]
    if importlib.util.find_spec("tensorboard") is not None:
        kinds.append(LoggerType.TENSORBOARD)
    return kinds


def resolve_log_with(log_with: Any) -> list[type[GeneralTracker] | GeneralTracker]:
    """Tracker classes (to build at ``init_trackers``) or ready tracker objects, in order."""
    if log_with is None:
        return []
    items: Sequence[Any] = log_with if isinstance(log_with, (list, tuple)) else [log_with]
    resolved: list[type[GeneralTracker] | GeneralTracker] = []
    for item in items:
        if isinstance(item, GeneralTracker):
            resolved.append(item)
            continue
        kind = LoggerType.parse(item, argument="log_with")
        kinds = available_kinds() if kind == LoggerType.ALL else [kind]
        resolved.extend(tracker_class(k) for k in kinds)
    return resolved


def build_trackers(
    specs: Sequence[type[GeneralTracker] | GeneralTracker],
    project_name: str,
    *,
    logging_dir: str | None,
    init_kwargs: dict[str, dict[str, Any]] | None,
    is_main_process: bool,
) -> list[GeneralTracker]:
    """Instantiate the trackers this process runs (main-process-only trackers run on the main process)."""
    trackers: list[GeneralTracker] = []
    for spec in specs:
        if not is_main_process and spec.main_process_only:
            continue
        if isinstance(spec, GeneralTracker):
            trackers.append(spec)
            continue
        if spec.requires_logging_directory and logging_dir is None:
            raise ValueError(
                f"The {spec.name} tracker writes files and needs a logging directory: pass "
                "Accelerator(project_dir=...) or ProjectConfiguration(logging_dir=...)."
            )
        trackers.append(spec(project_name, logging_dir, **(init_kwargs or {}).get(spec.name, {})))
    return trackers


class DisabledTracker(GeneralTracker):
    """What ``get_tracker`` returns on processes that do not log: every call does nothing."""

    def __init__(self, name: str) -> None:
        self.name = name

    @property
    def tracker(self) -> Any:
        return None

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        return None
