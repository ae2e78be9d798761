"""Read the JSON lines a ``jsonl`` tracker wrote into per-metric series.

Each line is ``{"step": ..., "time": ..., "<metric>": value, ...}`` (see :mod:`lockstep.tracking.files`).
A line cut short by a crash is skipped and counted; values that are not numbers (text) are ignored.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from lockstep.errors import UsageError
from lockstep.tracking.files import EVENT_KEY

METRICS_FILE = "metrics.jsonl"


@dataclass
class Series:
    """One metric: ``steps[i]`` and ``values[i]``, in the order logged."""

    steps: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.values)


@dataclass
class RunLog:
    """The metrics of one run.

    Attributes:
        path: the ``metrics.jsonl`` file.
        name: the run's folder name (the project name given to ``init_trackers``).
        series: metric name -> its series (numbers only).
        times: the ``time`` field of every record (seconds since the epoch).
        records: number of records read.
        skipped_lines: lines that were not JSON objects (a run killed mid-write leaves one).
        events: ``(step, text)`` of each record with an event (:data:`EVENT_KEY`), in the order logged.
    """

    path: Path
    name: str
    series: dict[str, Series] = field(default_factory=dict)
    times: list[float] = field(default_factory=list)
    records: int = 0
    skipped_lines: int = 0
    events: list[tuple[float, str]] = field(default_factory=list)

    def keys(self) -> list[str]:
        return list(self.series)


def find_metric_files(run_dir: str | Path) -> list[Path]:
    """The ``metrics.jsonl`` files ``run_dir`` names: itself (a file), in it, or in its subfolders.

    Raises:
        UsageError: when there is no such file.
    """
    path = Path(run_dir)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise UsageError(f"{str(run_dir)!r} does not exist: give a run folder holding {METRICS_FILE}.")
    if (path / METRICS_FILE).is_file():
        return [path / METRICS_FILE]
    found = sorted(path.glob(f"*/{METRICS_FILE}"))
    if not found:
        raise UsageError(
            f"no {METRICS_FILE} in {str(run_dir)!r} or its subfolders: train with "
            "Accelerator(log_with='jsonl', project_dir=...) and give logging_dir/project_name."
        )
    return found


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def read_run(path: str | Path) -> RunLog:
    """Read one ``metrics.jsonl``; records without a step are placed at their index among the records."""
    path = Path(path)
    run = RunLog(path=path, name=path.parent.name or path.stem)
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                run.skipped_lines += 1
                continue
            if not isinstance(record, dict):
                run.skipped_lines += 1
                continue
            _add_record(run, record)
    return run


def _add_record(run: RunLog, record: dict) -> None:
    step = _number(record.get("step"))
    if step is None:
        step = float(run.records)
    when = _number(record.get("time"))
    if when is not None:
        run.times.append(when)
    run.records += 1
    if isinstance(record.get(EVENT_KEY), str):
        run.events.append((step, record[EVENT_KEY]))
    for key, value in record.items():
        number = _number(value)
        if key in ("step", "time") or number is None:
            continue
        series = run.series.setdefault(key, Series())
        series.steps.append(step)
        series.values.append(number)


# What the report plots, by metric name.
THROUGHPUT_KEYS = ("samples_per_second", "tokens_per_second", "flops_per_second")
UNITS = {"samples_per_second": "samples/s", "tokens_per_second": "tokens/s", "flops_per_second": "FLOP/s"}
STEP_TIME_TOTAL = "time/step"
COMMUNICATION = "time/communication"  # part of time/forward_backward, not a phase of its own


def loss_keys(run: RunLog) -> list[str]:
    """``loss`` and every metric named like a loss (``eval_loss``, ``loss/train``...)."""
    return [key for key in run.series if "loss" in key.lower()]


def lr_keys(run: RunLog) -> list[str]:
    """``lr``, ``learning_rate`` and their per-group variants (``lr/group_0``, ``lr_head``...)."""
    names = ("lr", "learning_rate")
    return [
        key
        for key in run.series
        if key in names or key.startswith(tuple(f"{n}{s}" for n in names for s in "/_"))
    ]


def throughput_keys(run: RunLog) -> list[str]:
    return [key for key in THROUGHPUT_KEYS if key in run.series]


def phase_keys(run: RunLog) -> list[str]:
    """The ``time/*`` phases that add up to a step (not the total, not the overlapping communication)."""
    return [
        key for key in run.series if key.startswith("time/") and key not in (STEP_TIME_TOTAL, COMMUNICATION)
    ]
