"""The one place that turns ``log_with`` into tracker classes."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lockstep.config.enums import LoggerType
from lockstep.tracking.base import GeneralTracker
from lockstep.tracking.files import CSVTracker, JSONLTracker


@dataclass(frozen=True)
class _Optional:
    """A tracker that needs a package: ``package`` to use it, ``extras`` too for ``"all"`` to pick it."""

    package: str
    module: str
    class_name: str
    install: str
    extras: tuple[str, ...] = ()


_OPTIONAL = {
    LoggerType.TENSORBOARD: _Optional(
        "tensorboard", "tensorboard", "TensorBoardTracker", "pip install tensorboard"
    ),
    # The local SQLite store needs sqlalchemy and alembic; a remote tracking_uri does not.
    LoggerType.MLFLOW: _Optional(
        "mlflow",
        "mlflow",
        "MLflowTracker",
        "pip install mlflow-skinny sqlalchemy alembic",
        ("sqlalchemy", "alembic"),
    ),
    LoggerType.WANDB: _Optional("wandb", "wandb", "WandBTracker", "pip install wandb"),
}


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def tracker_class(kind: LoggerType) -> type[GeneralTracker]:
    optional = _OPTIONAL.get(kind)
    if optional is None:
        return {LoggerType.JSONL: JSONLTracker, LoggerType.CSV: CSVTracker}[kind]
    if not _installed(optional.package):
        raise ImportError(f"log_with='{kind.value}' needs the {optional.package} package: {optional.install}")
    return getattr(importlib.import_module(f"lockstep.tracking.{optional.module}"), optional.class_name)


def available_kinds() -> list[LoggerType]:
    """What ``log_with="all"`` means here: the built-in trackers whose packages are installed."""
    kinds = [LoggerType.JSONL, LoggerType.CSV]
    for kind, optional in _OPTIONAL.items():
        if all(_installed(package) for package in (optional.package, *optional.extras)):
            kinds.append(kind)
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
