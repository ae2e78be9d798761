"""Trackers: files from a real 2-process run, read back by their own readers, hold each value once."""

import csv
import json
from pathlib import Path

import pytest
import torch

from lockstep import Accelerator
from lockstep.tracking import GeneralTracker
from tests.helpers.multiprocess import run_distributed


def _train_and_log(project_dir: str) -> list[str]:
    accelerator = Accelerator(log_with=["jsonl", "csv", "tensorboard"], project_dir=project_dir)
    accelerator.init_trackers("run", config={"lr": 0.1, "batch": 4, "model": "mlp"})
    for step in range(1, 4):
        loss = torch.tensor(1.0 / step) * (accelerator.process_index + 1)  # differs per rank: main must win
        accelerator.log({"loss": loss, "note": f"step {step}"}, step=step)
    accelerator.log({"eval_accuracy": 0.75}, step=3)
    names = [t.name for t in accelerator.trackers]
    writer = accelerator.get_tracker("tensorboard", unwrap=True)
    accelerator.end_training()
    return [*names, type(writer).__name__]


def test_trackers_write_each_value_once_from_the_main_process(tmp_path):
    rank0, rank1 = run_distributed(_train_and_log, 2, str(tmp_path))
    assert rank0 == ["jsonl", "csv", "tensorboard", "SummaryWriter"]
    assert rank1 == ["NoneType"]  # other ranks start no tracker; get_tracker gives a stand-in
    run = tmp_path / "run"
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r.get("loss"), r.get("eval_accuracy")) for r in lines] == [
        (1, 1.0, None),
        (2, 0.5, None),
        (3, pytest.approx(1 / 3), None),
        (3, None, 0.75),
    ]
    assert json.loads((run / "config.json").read_text()) == {"lr": 0.1, "batch": 4, "model": "mlp"}
    with open(run / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["step"], r["loss"], r["eval_accuracy"]) for r in rows] == [
        ("1", "1.0", ""),
        ("2", "0.5", ""),
        ("3", str(torch.tensor(1 / 3).item()), ""),
        ("3", "", "0.75"),
    ]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run))
    events.Reload()
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("loss")] == [
        (1, 1.0),
        (2, 0.5),
        (3, 0.333333),
    ]
    assert [(e.step, e.value) for e in events.Scalars("eval_accuracy")] == [(3, 0.75)]


class _ListTracker(GeneralTracker):
    name = "list"

    def __init__(self) -> None:
        self.records = []
        self.config = None
        self.finished = False

    @property
    def tracker(self):
        return self.records

    def store_init_configuration(self, values):
        self.config = values

    def log(self, values, step=None, **kwargs):
        self.records.append((step, values, kwargs))

    def finish(self):
        self.finished = True


def test_user_tracker_and_log_kwargs():
    tracker = _ListTracker()
    accelerator = Accelerator(log_with=tracker)
    accelerator.init_trackers("x", config={"a": 1})
    accelerator.log({"m": 2}, step=5, log_kwargs={"list": {"commit": False}})
    assert (
        accelerator.get_tracker("list") is tracker
        and accelerator.get_tracker("list", unwrap=True) is tracker.records
    )
    accelerator.end_training()
    assert (
        tracker.config == {"a": 1}
        and tracker.records == [(5, {"m": 2}, {"commit": False})]
        and tracker.finished
    )


def test_tracker_errors(tmp_path):
    with pytest.raises(ValueError, match="log_with='nope' is invalid: it must be one of"):
        Accelerator(log_with="nope")
    with pytest.raises(NotImplementedError, match="log_with='mlflow' is not supported yet"):
        Accelerator(log_with="mlflow")
    accelerator = Accelerator(log_with="jsonl")
    with pytest.raises(ValueError, match="The jsonl tracker writes files and needs a logging directory"):
        accelerator.init_trackers("run")
    with pytest.raises(ValueError, match=r"get_tracker\('csv'\): no such tracker was configured"):
        accelerator.get_tracker("csv")


def test_log_with_all_uses_every_installed_tracker(tmp_path):
    accelerator = Accelerator(log_with="all", project_dir=str(tmp_path))
    accelerator.init_trackers("all")
    assert [t.name for t in accelerator.trackers] == ["jsonl", "csv", "tensorboard"]
    accelerator.end_training()
    assert Path(tmp_path / "all" / "metrics.jsonl").exists()
