"""Trackers: files from a real 2-process run, read back by their own readers, hold each value once."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lockstep import Accelerator
from lockstep.tracking import GeneralTracker
from tests.helpers.multiprocess import run_distributed
from tests.helpers.optional import requires


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


@pytest.mark.distributed
@requires("tensorboard")
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
    accelerator = Accelerator(log_with="jsonl")  # lockstep's own file trackers take the folder at start
    with pytest.raises(
        ValueError,
        match=r"Logging with `jsonl` requires a `logging_dir` to be passed in: log_with='jsonl' writes files "
        r"under logging_dir/project_name and no folder is set\. Pass Accelerator\(project_dir=\.\.\.\)",
    ):
        accelerator.init_trackers("run")
    assert accelerator.trackers == []
    with pytest.raises(ValueError, match=r"get_tracker\('csv'\): no such tracker was configured"):
        accelerator.get_tracker("csv")


@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")
@requires("tensorboard", "mlflow", "wandb")
def test_log_with_all_uses_every_installed_tracker(tmp_path):
    accelerator = Accelerator(log_with="all", project_dir=str(tmp_path))
    accelerator.init_trackers("all", init_kwargs={"wandb": {"mode": "offline"}})
    assert [t.name for t in accelerator.trackers] == ["jsonl", "csv", "tensorboard", "mlflow", "wandb"]
    accelerator.end_training()
    assert {p.name for p in (tmp_path / "all").iterdir()} >= {"metrics.jsonl", "mlflow.db", "wandb"}


@pytest.mark.parametrize(
    ("package", "install"),
    [
        ("mlflow", "pip install mlflow-skinny sqlalchemy alembic"),
        ("wandb", "pip install wandb"),
        ("tensorboard", "pip install tensorboard"),
    ],
)
def test_missing_tracker_package_is_an_import_error_with_the_pip_line(monkeypatch, package, install):
    monkeypatch.setitem(sys.modules, package, None)  # what import sees when the package is not installed
    with pytest.raises(ImportError, match=f"log_with='{package}' needs the {package} package: {install}$"):
        Accelerator(log_with=package)
    accelerator = Accelerator(log_with="all")
    names = accelerator._trackers.names
    assert names[:2] == ["jsonl", "csv"] and package not in names


@requires("mlflow")
def test_mlflow_store_without_sqlalchemy_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "alembic", None)
    accelerator = Accelerator(log_with="mlflow", project_dir=str(tmp_path))
    with pytest.raises(
        ImportError, match=r"local SQLite store, which needs alembic: pip install mlflow-skinny"
    ):
        accelerator.init_trackers("run")
    assert "mlflow" not in Accelerator(log_with="all")._trackers.names


def _train_and_log_to_mlflow_and_wandb(project_dir: str) -> list[str]:
    accelerator = Accelerator(log_with=["mlflow", "wandb"], project_dir=project_dir)
    accelerator.init_trackers(
        "run",
        config={"lr": 0.1, "batch": 4, "model": "mlp"},
        init_kwargs={"wandb": {"mode": "offline"}, "mlflow": {"run_name": "first"}},
    )
    for step in range(1, 4):
        loss = torch.tensor(1.0 / step) * (accelerator.process_index + 1)  # differs per rank: main must win
        accelerator.log({"loss": loss, "note": f"step {step}"}, step=step)
    accelerator.log({"eval": {"accuracy": 0.75}}, step=3)
    mlflow_run = accelerator.get_tracker("mlflow", unwrap=True)
    run_id = mlflow_run.info.run_id if mlflow_run is not None else None
    wandb_run = accelerator.get_tracker("wandb").run if accelerator.is_main_process else None
    wandb_dir = wandb_run.dir if wandb_run is not None else None
    accelerator.end_training()
    return [run_id, wandb_dir]


# mlflow 3.17's SQL store uses an option SQLAlchemy 2.1 deprecates; the tracker hides it, the reader here not.
@pytest.mark.distributed
@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")
@requires("mlflow", "wandb")
def test_mlflow_and_wandb_runs_read_back_by_their_own_libraries(tmp_path):
    from mlflow import MlflowClient

    (run_id, wandb_files), (other_run_id, other_dir) = run_distributed(
        _train_and_log_to_mlflow_and_wandb, 2, str(tmp_path), timeout=120
    )
    assert other_run_id is None and other_dir is None
    run = tmp_path / "run"
    client = MlflowClient(f"sqlite:///{run / 'mlflow.db'}")
    [experiment] = [e for e in client.search_experiments() if e.name == "run"]
    [mlflow_run] = client.search_runs([experiment.experiment_id])
    assert mlflow_run.info.run_id == run_id and mlflow_run.info.status == "FINISHED"
    assert mlflow_run.info.run_name == "first"
    assert mlflow_run.data.params == {"lr": "0.1", "batch": "4", "model": "mlp"}
    history = client.get_metric_history(run_id, "loss")
    assert [(m.step, round(m.value, 6)) for m in history] == [(1, 1.0), (2, 0.5), (3, 0.333333)]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "eval/accuracy")] == [(3, 0.75)]
    assert set(mlflow_run.data.metrics) == {"loss", "eval/accuracy"}  # text is not a metric

    # wandb's own reader of the offline transaction log (the .wandb file).
    wandb_cli = Path(sys.executable).parent / "wandb"
    offline_run = Path(wandb_files).parent
    assert offline_run.parent == run / "wandb" and offline_run.name.startswith("offline-run-")
    listing = subprocess.run(
        [str(wandb_cli), "leet", "inspect", "--json", str(offline_run)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    records = [json.loads(line) for line in listing.splitlines()]
    [run_record] = [r["run"] for r in records if r["type"] == "run"]
    assert run_record["project"] == "run"
    config = {
        k: v for r in records if r["type"] == "config" for k, v in r["config"].get("update", {}).items()
    }
    assert {k: config[k] for k in ("lr", "batch", "model")} == {"lr": 0.1, "batch": 4, "model": "mlp"}
    rows = [r["history"]["item"] for r in records if r["type"] == "history"]
    assert [(row["_step"], row.get("loss"), row.get("note")) for row in rows] == [
        (1, 1.0, "step 1"),
        (2, 0.5, "step 2"),
        (3, pytest.approx(1 / 3), "step 3"),
    ]
    assert rows[2]["eval.accuracy"] == 0.75  # same step: merged into step 3's row, nested keys dotted
    assert [r["exit"]["exit_code"] for r in records if r["type"] == "exit"] == [0]


@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")
@requires("mlflow")
def test_mlflow_runs_of_two_projects_in_one_process_keep_their_own_stores(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)

    for name in ("a", "b"):
        accelerator = Accelerator(log_with="mlflow", project_dir=str(tmp_path / name))
        accelerator.init_trackers(name, config={"long": "x" * 7000})
        accelerator.log({"loss": 1.0}, step=0)
        accelerator.end_training()
    for name in ("a", "b"):
        client = MlflowClient(f"sqlite:///{tmp_path / name / name / 'mlflow.db'}")
        [run] = client.search_runs([client.get_experiment_by_name(name).experiment_id])
        assert run.data.metrics == {"loss": 1.0} and run.data.params == {}  # over MLflow's cap: left out
        assert (
            run.info.artifact_uri
            == (tmp_path / name / name / "mlartifacts").as_uri() + f"/{run.info.run_id}/artifacts"
        )
    assert "MLFLOW_TRACKING_URI" not in os.environ  # the user's environment is left as it was
    # A store the user chose with MLFLOW_TRACKING_URI wins over the logging folder, as in Accelerate.
    chosen = f"sqlite:///{tmp_path / 'chosen.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", chosen)
    accelerator = Accelerator(log_with="mlflow", project_dir=str(tmp_path / "c"))
    accelerator.init_trackers("c")
    accelerator.log({"loss": 2.0}, step=1)
    accelerator.end_training()
    client = MlflowClient(chosen)
    [run] = client.search_runs([client.get_experiment_by_name("c").experiment_id])
    assert run.data.metrics == {"loss": 2.0} and not (tmp_path / "c" / "c" / "mlflow.db").exists()
    assert os.environ["MLFLOW_TRACKING_URI"] == chosen


@requires("tensorboard")
def test_tensorboard_hyperparameters_are_stored_as_accelerate_stores_them(tmp_path):
    import yaml
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer
    from tensorboard.plugins.hparams import plugin_data_pb2

    accelerator = Accelerator(log_with="tensorboard", project_dir=str(tmp_path))
    config = {"lr": 0.1, "epochs": 3, "model": "mlp", "warmup": None, "fp16": False}
    accelerator.init_trackers("run", config=config)
    accelerator.end_training()

    (hparams_file,) = (tmp_path / "run").glob("*/hparams.yml")
    assert yaml.safe_load(hparams_file.read_text()) == config  # the whole configuration, None included
    multiplexer = EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(tmp_path / "run"))
    multiplexer.Reload()
    stored = {}
    for run, tags in multiplexer.PluginRunToTagToContent("hparams").items():
        for content in tags.values():
            data = plugin_data_pb2.HParamsPluginData.FromString(content)
            if data.HasField("session_start_info"):
                stored = {k: v for k, v in data.session_start_info.hparams.items()}
                assert run != "."  # a run folder of its own, named by the time, as Accelerate's writer makes
    assert {k: v.WhichOneof("kind") for k, v in stored.items()} == {
        "lr": "number_value",
        "epochs": "number_value",
        "model": "string_value",
        "fp16": "number_value",  # torch stores a bool as a number, for Accelerate too
    }  # warmup=None is left out, not stored as the text 'None'
