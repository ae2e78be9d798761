"""A backend spec and a tracker written outside ``src/``, for the test that one installed distribution adds
every kind of extension through its entry points (tests/test_entry_points.py). The cluster environment and
the storage of that distribution are tests/plugins/lab_cluster.py and tests/checkpoint/vault_storage.py."""

from __future__ import annotations

from typing import Any

from lockstep.config.backend_specs import BackendSpec
from lockstep.tracking import GeneralTracker


def _never(request: Any) -> bool:
    return False


LAB_BACKEND = BackendSpec(
    name="lab-backend",
    priority=99,
    applies=_never,  # listed, never chosen: the test checks registration, not training
    build="tests.plugins.lab_extensions:_never",
    summary="the lab's backend (a test plugin)",
)


class LabTracker(GeneralTracker):
    """Keeps what it is given in ``logged``."""

    name = "lab-tracker"
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        self.run_name = run_name
        self.logged: list[tuple[int | None, dict[str, Any]]] = []

    @property
    def tracker(self) -> list[tuple[int | None, dict[str, Any]]]:
        return self.logged

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.logged.append((step, dict(values)))


class NotATracker:
    """What a broken package might name in the ``lockstep.trackers`` group."""
