"""Trackers open their resources in start(), which init_trackers calls on the processes that log."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO, Any

import pytest

from lockstep import Accelerator
from lockstep.tracking import (
    CSVTracker,
    GeneralTracker,
    JSONLTracker,
    MLflowTracker,
    TensorBoardTracker,
    WandBTracker,
    on_main_process,
)
from tests.helpers.multiprocess import run_distributed
from tests.helpers.optional import requires


class _OpensInStart(GeneralTracker):
    """A tracker written the Accelerate way: __init__ stores, start() opens."""

    name = "opens-in-start"
    requires_logging_directory = False

    def __init__(self, path: str) -> None:
        self.path = path
        self.file: IO[str] | None = None
        self.calls: list[Any] = []

    def start(self) -> None:
        self.calls.append("start")
        self.file = open(self.path, "a", encoding="utf-8")

    @property
    def tracker(self) -> IO[str] | None:
        return self.file

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.calls.append(("config", dict(values)))
        self.file.write(json.dumps({"config": values}) + "\n")

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.calls.append(("log", step))
        self.file.write(json.dumps({"step": step, **values}) + "\n")

    def finish(self) -> None:
        self.calls.append("finish")
        self.file.close()


class _EveryProcess(_OpensInStart):
    name = "every-process"
    main_process_only = False


def test_init_trackers_starts_a_custom_tracker_before_its_configuration(tmp_path):
    path = tmp_path / "custom.jsonl"
    tracker = _OpensInStart(str(path))
    accelerator = Accelerator(log_with=tracker)
    assert tracker.calls == [] and not path.exists()  # building the Accelerator opens nothing
    accelerator.init_trackers("run", config={"lr": 0.1})
    accelerator.log({"loss": 0.5}, step=3)
    accelerator.end_training()
    assert tracker.calls == ["start", ("config", {"lr": 0.1}), ("log", 3), "finish"]
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [{"config": {"lr": 0.1}}, {"step": 3, "loss": 0.5}]


def test_a_tracker_that_opens_in_init_keeps_working(tmp_path):
    class OpensInInit(GeneralTracker):  # written for lockstep before start() existed
        name = "opens-in-init"

        def __init__(self) -> None:
            self.records: list[Any] = []

        @property
        def tracker(self) -> list[Any]:
            return self.records

        def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
            self.records.append((step, values))

    tracker = OpensInInit()
    accelerator = Accelerator(log_with=[tracker, "jsonl"], project_dir=str(tmp_path))
    accelerator.init_trackers("run")
    accelerator.log({"loss": 1.0}, step=1)
    accelerator.end_training()
    assert tracker.records == [(1, {"loss": 1.0})]


def test_file_trackers_touch_the_disk_only_when_started(tmp_path):
    jsonl, csv_tracker = JSONLTracker("run", tmp_path), CSVTracker("run", tmp_path)
    assert not (tmp_path / "run").exists() and jsonl.tracker is None
    with pytest.raises(
        RuntimeError,
        match=r"The jsonl tracker was used before it was started: call tracker\.start\(\) first "
        r"\(Accelerator\.init_trackers does this for the trackers given as log_with\)\.",
    ):
        jsonl.log({"loss": 1.0}, step=1)
    with pytest.raises(RuntimeError, match=r"The csv tracker was used before it was started"):
        csv_tracker.log({"loss": 1.0}, step=1)
    jsonl.start()
    csv_tracker.start()
    jsonl.log({"loss": 1.0}, step=1)
    csv_tracker.log({"loss": 1.0}, step=1)
    jsonl.finish()
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text())["loss"] == 1.0
    assert (tmp_path / "run" / "metrics.csv").read_text().splitlines()[0] == "step,time,loss"


@requires("tensorboard", "mlflow", "wandb")
def test_package_trackers_open_nothing_until_started(tmp_path):
    tensorboard = TensorBoardTracker("run", tmp_path)
    mlflow_tracker = MLflowTracker("run", tmp_path)
    wandb_tracker = WandBTracker("run", tmp_path, mode="offline")
    assert (tensorboard.tracker, mlflow_tracker.tracker, wandb_tracker.tracker) == (None, None, None)
    assert not (tmp_path / "run").exists()
    with pytest.raises(RuntimeError, match="The tensorboard tracker was used before it was started"):
        tensorboard.log({"loss": 1.0}, step=1)
    with pytest.raises(RuntimeError, match="The mlflow tracker was used before it was started"):
        mlflow_tracker.store_init_configuration({"lr": 0.1})
    with pytest.raises(RuntimeError, match="The wandb tracker was used before it was started"):
        wandb_tracker.log({"loss": 1.0}, step=1)
    for tracker in (tensorboard, mlflow_tracker, wandb_tracker):
        tracker.finish()  # finishing a tracker that never started does nothing
    assert not (tmp_path / "run").exists()


def _start_on_two_processes(folder: str) -> dict[str, Any]:
    rank = int(os.environ["RANK"])
    main_only = _OpensInStart(str(Path(folder) / f"main-only-{rank}.jsonl"))
    everywhere = _EveryProcess(str(Path(folder) / f"every-process-{rank}.jsonl"))
    accelerator = Accelerator(log_with=[main_only, everywhere, "jsonl"], project_dir=folder)
    accelerator.init_trackers("run", config={"lr": 0.1})
    accelerator.log({"loss": 0.5}, step=1)
    main_only_direct = main_only.log({"loss": 0.5}, step=2) if rank == 1 else None  # on_main_process: skipped
    started = [tracker.name for tracker in accelerator.trackers]
    accelerator.end_training()
    return {
        "started": started,
        "main_only": main_only.calls,
        "everywhere": everywhere.calls,
        "direct": main_only_direct,
    }


@pytest.mark.distributed
def test_main_process_only_trackers_start_on_the_main_process_only(tmp_path):
    rank0, rank1 = run_distributed(_start_on_two_processes, 2, str(tmp_path))
    started = ["start", ("config", {"lr": 0.1}), ("log", 1), "finish"]
    assert rank0 == {
        "started": ["opens-in-start", "every-process", "jsonl"],
        "main_only": started,
        "everywhere": started,
        "direct": None,
    }
    # Rank 1 never started the main-process-only trackers: nothing opened, nothing written.
    assert rank1 == {"started": ["every-process"], "main_only": [], "everywhere": started, "direct": None}
    assert sorted(p.name for p in tmp_path.glob("*.jsonl")) == [
        "every-process-0.jsonl",
        "every-process-1.jsonl",
        "main-only-0.jsonl",
    ]
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 1
