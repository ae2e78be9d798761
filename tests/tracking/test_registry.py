"""Trackers by name, as in Accelerate: LOGGER_TYPE_TO_CLASS, filter_trackers, the logging folder check."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

from lockstep import Accelerator, LoggerType
from lockstep.tracking import (
    LOGGER_TYPE_TO_CLASS,
    CSVTracker,
    GeneralTracker,
    JSONLTracker,
    MLflowTracker,
    TensorBoardTracker,
    WandBTracker,
    filter_trackers,
    get_available_trackers,
)
from tests.helpers.optional import requires


class _Recorder(GeneralTracker):
    """Records how init_trackers built and started it."""

    name = "recorder"
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        self.args = (run_name, kwargs)
        self.started = False
        self.records: list[Any] = []

    def start(self) -> None:
        self.started = True

    @property
    def tracker(self) -> list[Any]:
        return self.records

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.records.append((step, values))


class _FolderRecorder(_Recorder):
    name = "csv"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str, **kwargs: Any) -> None:
        super().__init__(run_name, logging_dir=logging_dir, **kwargs)


class _OptionalFolderRecorder(_Recorder):
    def __init__(self, run_name: str, logging_dir: str | None = None, **kwargs: Any) -> None:
        super().__init__(run_name, logging_dir=logging_dir, **kwargs)


def test_logger_type_to_class_maps_every_name_to_its_tracker():
    assert LOGGER_TYPE_TO_CLASS == {
        "jsonl": JSONLTracker,
        "csv": CSVTracker,
        "tensorboard": TensorBoardTracker,
        "mlflow": MLflowTracker,
        "wandb": WandBTracker,
    }
    assert all(LOGGER_TYPE_TO_CLASS[name].name == name for name in LOGGER_TYPE_TO_CLASS)


def test_a_class_put_in_the_table_is_used_when_the_trackers_start(tmp_path, monkeypatch):
    accelerator = Accelerator(log_with=["csv"], project_dir=str(tmp_path))
    monkeypatch.setitem(LOGGER_TYPE_TO_CLASS, "csv", _FolderRecorder)  # after the constructor, as Accelerate
    accelerator.init_trackers("run", init_kwargs={"csv": {"flush": True}})
    [tracker] = accelerator.trackers
    assert type(tracker) is _FolderRecorder and tracker.started
    assert tracker.args == ("run", {"logging_dir": str(tmp_path), "flush": True})
    assert not (tmp_path / "run").exists()  # lockstep's CSVTracker was not built


def test_a_name_registered_in_the_table_is_accepted_by_log_with(tmp_path, monkeypatch):
    monkeypatch.setitem(LOGGER_TYPE_TO_CLASS, "recorder", _Recorder)
    monkeypatch.setitem(LOGGER_TYPE_TO_CLASS, "with-folder", _OptionalFolderRecorder)
    accelerator = Accelerator(log_with=["recorder", "with-folder"], project_dir=str(tmp_path))
    assert accelerator._trackers.specs == ["recorder", "with-folder"]
    accelerator.init_trackers("run", init_kwargs={"recorder": {"prefix": ">"}})
    plain, with_folder = accelerator.trackers
    assert plain.args == ("run", {"prefix": ">"})  # no logging_dir: its __init__ has no such parameter
    assert with_folder.args == ("run", {"logging_dir": str(tmp_path)})
    accelerator.log({"loss": 0.5}, step=2)
    assert accelerator.get_tracker("recorder", unwrap=True) == [(2, {"loss": 0.5})]
    monkeypatch.delitem(LOGGER_TYPE_TO_CLASS, "recorder")
    with pytest.raises(
        ValueError, match=r"log_with='recorder': no tracker class is registered under that name in lockstep"
    ):
        accelerator.init_trackers("again")


def test_filter_trackers_drops_repeats_expands_all_and_keeps_objects(monkeypatch):
    tracker = _Recorder("mine")
    found = filter_trackers(["jsonl", LoggerType.CSV, "JSONL", tracker, "csv"], logging_dir="runs")
    assert found == [LoggerType.JSONL, LoggerType.CSV, tracker]
    monkeypatch.setitem(sys.modules, "wandb", None)  # what import sees when wandb is not installed
    available = [str(kind) for kind in get_available_trackers()]
    assert available[:2] == ["jsonl", "csv"] and "wandb" not in available
    # "all" needs no folder at construction (as in Accelerate): file trackers say so when they start.
    assert filter_trackers([tracker, "all", "jsonl"]) == [tracker, *get_available_trackers()]
    assert filter_trackers(None) == []


def test_repeated_names_start_one_tracker_each(tmp_path):
    accelerator = Accelerator(log_with=["jsonl", "csv", "jsonl"], project_dir=str(tmp_path))
    accelerator.init_trackers("run")
    accelerator.log({"loss": 0.5}, step=1)
    assert [tracker.name for tracker in accelerator.trackers] == ["jsonl", "csv"]
    accelerator.end_training()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["loss"] for line in lines] == [0.5]  # written once, not once per repeat


@requires("tensorboard")
def test_tensorboard_without_a_logging_dir_is_refused_when_the_accelerator_is_built(tmp_path):
    message = (
        r"Logging with `tensorboard` requires a `logging_dir` to be passed in: log_with='tensorboard' writes "
        r"files under logging_dir/project_name and no folder is set\. Pass Accelerator\(project_dir=\.\.\.\) "
        r"or Accelerator\(project_config=ProjectConfiguration\(logging_dir=\.\.\.\)\)\.$"
    )
    with pytest.raises(ValueError, match=message):
        Accelerator(log_with="tensorboard")
    with pytest.raises(ValueError, match=message):
        filter_trackers(["jsonl", LoggerType.TENSORBOARD])
    assert Accelerator(log_with="tensorboard", project_dir=str(tmp_path))._trackers.names == ["tensorboard"]


def test_log_with_entries_that_are_not_trackers_say_what_to_pass():
    with pytest.raises(
        ValueError,
        match=r"log_with='aim' is an Accelerate tracker that lockstep does not include: write a "
        r"GeneralTracker for it and pass an instance, or use one of 'all', 'jsonl', 'csv', 'tensorboard', "
        r"'mlflow', 'wandb'\.",
    ):
        Accelerator(log_with="aim")
    with pytest.raises(
        ValueError,
        match=r"log_with='nope' is invalid: it must be one of 'all', 'jsonl', 'csv', 'tensorboard', 'mlflow', "
        r"'wandb', or a GeneralTracker instance\.",
    ):
        filter_trackers(["jsonl", "nope"])
    with pytest.raises(
        TypeError,
        match=r"log_with=JSONLTracker is a tracker class: pass an instance, log_with=JSONLTracker\(\.\.\.\)",
    ):
        Accelerator(log_with=JSONLTracker)
