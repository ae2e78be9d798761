"""Dependency-free trackers writing plain files: JSON lines (the default the other tools read) and CSV."""

from __future__ import annotations

import csv
import json
import os
import time
from pathlib import Path
from typing import IO, Any

from lockstep.tracking.base import GeneralTracker, not_started, plain_value

EVENT_KEY = "lockstep/event"
"""A record's text event (a restart on another number of processes): ``lockstep report`` lists them."""


class JSONLTracker(GeneralTracker):
    """One JSON object per ``log`` call in ``logging_dir/run_name/metrics.jsonl``; config in ``config.json``.

    The folder and the file are made by ``start()`` (``init_trackers`` calls it).
    """

    name = "jsonl"
    requires_logging_directory = True
    _folder_checked_at_start = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, **kwargs: Any) -> None:
        self.folder = Path(logging_dir) / run_name
        self.path = self.folder / "metrics.jsonl"
        self._file: IO[str] | None = None

    def start(self) -> None:
        """Make the folder and open ``metrics.jsonl`` for appending."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")

    @property
    def tracker(self) -> Any:
        return self._file

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        if self._file is None:
            raise not_started(self)
        plain = {k: plain_value(v) for k, v in values.items()}
        (self.folder / "config.json").write_text(json.dumps(plain, indent=1, default=str))

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        if self._file is None:
            raise not_started(self)
        record = {"step": step, "time": time.time(), **{k: plain_value(v) for k, v in values.items()}}
        self._file.write(json.dumps(record, default=str) + "\n")
        self._file.flush()

    def finish(self) -> None:
        if self._file is not None:
            self._file.close()


class CSVTracker(GeneralTracker):
    """A wide CSV (``step``, ``time``, one column per metric) in ``logging_dir/run_name/metrics.csv``.

    A metric that appears later adds a column: the file is rewritten once with the wider header. The
    folder is made by ``start()`` (``init_trackers`` calls it).
    """

    name = "csv"
    requires_logging_directory = True
    _folder_checked_at_start = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, **kwargs: Any) -> None:
        self.folder = Path(logging_dir) / run_name
        self.path = self.folder / "metrics.csv"
        self.columns: list[str] = ["step", "time"]
        self.rows: list[dict[str, Any]] = []
        self._started = False

    def start(self) -> None:
        """Make the folder."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self._started = True

    @property
    def tracker(self) -> Any:
        return self.path

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        if not self._started:
            raise not_started(self)
        row = {"step": step, "time": time.time(), **{k: plain_value(v) for k, v in values.items()}}
        new = [k for k in row if k not in self.columns]
        self.rows.append(row)
        if new or not self.path.exists():
            self.columns += new
            self._rewrite()
        else:
            with open(self.path, "a", newline="", encoding="utf-8") as handle:
                csv.DictWriter(handle, fieldnames=self.columns).writerow(row)

    def _rewrite(self) -> None:
        with open(self.path, "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=self.columns)
            writer.writeheader()
            writer.writerows(self.rows)
