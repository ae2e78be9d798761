"""register_tracker_class (Accelerate 1.15's extension point): a tracker class defined here is accepted by
name in Accelerator(log_with=...) and TrainingArguments(report_to=...), as the built-in trackers are, and
every list of tracker names (LoggerType, "all", lockstep env, report_to) comes from the one table."""

from __future__ import annotations

import contextlib
import io
import re
from typing import Any

import pytest
from torch import nn

import lockstep.utils
from lockstep import Accelerator, LoggerType, Trainer, TrainingArguments
from lockstep.cli.env_cmd import run_env, tracker_report
from lockstep.config.enums import BUILT_IN_TRACKERS
from lockstep.tracking import LOGGER_TYPE_TO_CLASS, GeneralTracker, register_tracker_class, registry
from tests.helpers.training import make_dataset, make_model

HERE = __name__


class MineTracker(GeneralTracker):
    """Keeps what it is given, so that the test can read it back."""

    name = "mine"
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        self.run_name = run_name
        self.kwargs = kwargs
        self.started = False
        self.finished = False
        self.config: dict[str, Any] | None = None
        self.records: list[tuple[int | None, dict[str, Any]]] = []

    def start(self) -> None:
        self.started = True

    @property
    def tracker(self) -> list[tuple[int | None, dict[str, Any]]]:
        return self.records

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.config = dict(values)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.records.append((step, dict(values)))

    def finish(self) -> None:
        self.finished = True


class FolderTracker(MineTracker):
    name = "mine-folder"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str, **kwargs: Any) -> None:
        super().__init__(run_name, **kwargs)
        self.logging_dir = logging_dir


class UninstalledTracker(MineTracker):
    name = "uninstalled"
    requires_packages = ("not_a_real_package_xyz",)
    install_command = "pip install not-a-real-package-xyz"


@pytest.fixture(autouse=True)
def _table_as_it_was():
    """What a test registers is gone after it: the other tests see the built-in table."""
    saved = dict(LOGGER_TYPE_TO_CLASS)
    yield
    LOGGER_TYPE_TO_CLASS.clear()
    LOGGER_TYPE_TO_CLASS.update(saved)


def test_a_registered_tracker_is_built_started_and_fed_by_the_accelerator():
    register_tracker_class(MineTracker)
    accelerator = Accelerator(log_with="mine")
    assert accelerator._trackers.names == ["mine"]
    accelerator.init_trackers("proj", config={"lr": 0.25, "layers": 2}, init_kwargs={"mine": {"tag": "a"}})
    accelerator.log({"loss": 0.5, "note": "first"}, step=1)
    accelerator.log({"loss": 0.125}, step=2)
    tracker = accelerator.get_tracker("mine")
    accelerator.end_training()
    assert type(tracker) is MineTracker and tracker.started and tracker.finished
    assert (tracker.run_name, tracker.kwargs) == ("proj", {"tag": "a"})
    assert tracker.config == {"lr": 0.25, "layers": 2}
    assert tracker.records == [(1, {"loss": 0.5, "note": "first"}), (2, {"loss": 0.125})]
    # Any case, in a list, repeated: one tracker, under its registered name.
    assert Accelerator(log_with=["Mine", "jsonl", "mine"], project_dir="unused")._trackers.names == [
        "mine",
        "jsonl",
    ]


def test_registering_a_taken_name_overwrites_it_with_a_warning(tmp_path):
    register_tracker_class(MineTracker)

    class OtherTracker(MineTracker):
        name = "mine"

    message = (
        f"A tracker with the name 'mine' is already registered ({HERE}.MineTracker) and is overwritten by "
        f"{HERE}.test_registering_a_taken_name_overwrites_it_with_a_warning.<locals>.OtherTracker: "
        "log_with='mine' now builds the new class."
    )
    with pytest.warns(UserWarning, match=f"^{re.escape(message)}$"):
        register_tracker_class(OtherTracker)
    assert LOGGER_TYPE_TO_CLASS["mine"] is OtherTracker

    class MyCSV(FolderTracker):  # a built-in name: the user's class replaces lockstep's
        name = "csv"

    with pytest.warns(
        UserWarning, match=r"'csv' is already registered \(lockstep\.tracking\.files\.CSVTracker\)"
    ):
        register_tracker_class(MyCSV)
    accelerator = Accelerator(log_with="csv", project_dir=str(tmp_path))
    accelerator.init_trackers("run")
    assert type(accelerator.get_tracker("csv")) is MyCSV
    assert not (tmp_path / "run").exists()  # lockstep's CSVTracker would have made its folder


def test_registering_what_is_not_a_tracker_class_raises_a_type_error():
    message = (
        r"^register_tracker_class\({}\) is invalid: it takes a subclass of lockstep\.tracking\.GeneralTracker "
        r"\(the class, not an instance\)\. Subclass GeneralTracker, set its name, and register the class\.$"
    )
    with pytest.raises(TypeError, match=message.format("dict")) as raised:
        register_tracker_class(dict)  # type: ignore[arg-type]
    assert isinstance(raised.value, ValueError)  # what Accelerate raises, for code written against it
    with pytest.raises(TypeError, match=message.format(r"<tests\.tracking\..*MineTracker object at 0x\w+>")):
        register_tracker_class(MineTracker("run"))  # type: ignore[arg-type]

    class Nameless(MineTracker):
        name = ""

    with pytest.raises(ValueError, match=r"register_tracker_class\(Nameless\) is invalid: its name is ''"):
        register_tracker_class(Nameless)

    class All(MineTracker):
        name = "all"

    with pytest.raises(ValueError, match=r"its name is 'all', and log_with finds a tracker by its name"):
        register_tracker_class(All)
    assert "" not in LOGGER_TYPE_TO_CLASS and "all" not in LOGGER_TYPE_TO_CLASS


def test_a_class_that_does_not_set_requires_logging_directory_is_refused_as_in_accelerate():
    """Accelerate's base class has no default for the flag; lockstep's default (for tracker objects passed
    to log_with) does not count when a class is registered by name."""

    class NoFlagTracker(GeneralTracker):
        name = "no-flag"

        @property
        def tracker(self) -> None:
            return None

    message = (
        r"^register_tracker_class\(NoFlagTracker\) is invalid: it does not set requires_logging_directory, which "
        r"tells log_with whether to build it with the logging folder\. Set the class attribute "
        r"requires_logging_directory = True if the tracker needs a logging directory, or False otherwise\.$"
    )
    with pytest.raises(ValueError, match=message):
        register_tracker_class(NoFlagTracker)
    assert "no-flag" not in LOGGER_TYPE_TO_CLASS

    class Inherited(MineTracker):  # set by a base of its own: accepted
        name = "inherited"

    register_tracker_class(Inherited)
    assert LOGGER_TYPE_TO_CLASS["inherited"] is Inherited


def test_a_registered_tracker_without_log_is_built_and_logs_nothing(tmp_path):
    """Accelerate's base class defines ``log`` (doing nothing), so a tracker that only keeps its run's
    configuration need not define it; lockstep's made it abstract and refused to build such a tracker."""

    class ConfigOnlyTracker(GeneralTracker):
        name = "config-only"
        requires_logging_directory = True

        def __init__(self, run_name: str, logging_dir: str, **kwargs: Any) -> None:
            super().__init__()
            self.run_name, self.logging_dir = run_name, logging_dir
            self.config: dict[str, Any] = {}

        @property
        def tracker(self) -> dict[str, Any]:
            return self.config

        def store_init_configuration(self, values: dict[str, Any]) -> None:
            self.config.update(values)

    register_tracker_class(ConfigOnlyTracker)
    accelerator = Accelerator(log_with="config-only", project_dir=str(tmp_path))
    accelerator.init_trackers("dir_project", config={"lr": 0.5})
    accelerator.log({"loss": 1.0}, step=0)
    tracker = accelerator.get_tracker("config-only")
    accelerator.end_training()
    assert type(tracker) is ConfigOnlyTracker
    assert (tracker.run_name, tracker.logging_dir, tracker.config) == (
        "dir_project",
        str(tmp_path),
        {"lr": 0.5},
    )


def test_requires_logging_directory_is_honoured(tmp_path):
    register_tracker_class(FolderTracker)
    message = (
        r"^Logging with `mine-folder` requires a `logging_dir` to be passed in: log_with='mine-folder' writes "
        r"files under logging_dir/project_name and no folder is set\. Pass Accelerator\(project_dir=\.\.\.\)"
    )
    with pytest.raises(ValueError, match=message):
        Accelerator(log_with="mine-folder")
    accelerator = Accelerator(log_with="mine-folder", project_dir=str(tmp_path))
    accelerator.init_trackers("run")
    tracker = accelerator.get_tracker("mine-folder")
    assert (tracker.run_name, tracker.logging_dir) == ("run", str(tmp_path))


def test_a_tracker_whose_package_is_missing_is_refused_by_name_and_shown_by_env():
    register_tracker_class(UninstalledTracker)
    with pytest.raises(
        ImportError,
        match=r"^log_with='uninstalled' needs the not_a_real_package_xyz package: "
        r"pip install not-a-real-package-xyz$",
    ):
        Accelerator(log_with="uninstalled")
    assert dict(tracker_report())["uninstalled"] == (
        f"not available, not_a_real_package_xyz not installed, pip install not-a-real-package-xyz "
        f"({HERE}.UninstalledTracker)"
    )


def test_unknown_names_list_the_registered_ones_and_all_stays_the_built_in_trackers():
    register_tracker_class(MineTracker)
    choices = "'all', 'jsonl', 'csv', 'tensorboard', 'mlflow', 'wandb', 'mine'"
    with pytest.raises(ValueError, match=rf"^log_with='nope' is invalid: it must be one of {choices}, or a "):
        Accelerator(log_with="nope")
    with pytest.raises(
        ValueError,
        match=rf"^TrainingArguments\(report_to='nope'\) is invalid: it must be one of {choices}, 'none'\. A "
        r"tracker class of your own is accepted once lockstep\.tracking\.register_tracker_class has registered",
    ):
        TrainingArguments(output_dir="unused", report_to=["mine", "nope"])
    assert TrainingArguments(output_dir="unused", report_to="MINE, jsonl").report_to == ["mine", "jsonl"]
    # "all" is every built-in tracker that can start (Accelerate's meaning): a registered one is named.
    assert TrainingArguments(output_dir="unused", report_to="all").report_to == ["all"]
    names = Accelerator(log_with=["all"], project_dir="unused")._trackers.names
    assert names == [str(kind) for kind in registry.get_available_trackers()] and "mine" not in names
    assert Accelerator(log_with=["all", "mine"], project_dir="unused")._trackers.names == [*names, "mine"]


def test_the_enum_the_env_report_and_report_to_come_from_the_one_table(capsys, tmp_path):
    assert [member.value for member in LoggerType] == ["all", *BUILT_IN_TRACKERS]
    assert LoggerType.TENSORBOARD == "tensorboard" and LoggerType.parse("CSV", argument="x") is LoggerType.CSV
    assert list(LOGGER_TYPE_TO_CLASS) == list(BUILT_IN_TRACKERS)
    for name, location in BUILT_IN_TRACKERS.items():
        assert location == f"{LOGGER_TYPE_TO_CLASS[name].__module__}:{LOGGER_TYPE_TO_CLASS[name].__name__}"
        # Where Accelerate has an is_<name>_available, a tracker that can start has its package.
        helper = getattr(lockstep.utils, f"is_{name}_available", None)
        assert helper is None or not LOGGER_TYPE_TO_CLASS[name].is_available() or helper(), name
    help_text = TrainingArguments.__dataclass_fields__["report_to"].metadata["help"]
    assert help_text.startswith(f"Trackers: {', '.join(BUILT_IN_TRACKERS)}, a name given to register_tracker")

    register_tracker_class(MineTracker)
    run_env(type("Args", (), {"config_file": str(tmp_path / "absent.yaml")})())
    output = capsys.readouterr().out
    trackers = output.split("Trackers (log_with / report_to names):\n")[1].split("\n\n")[0].splitlines()
    assert [line.split(":")[0].strip() for line in trackers] == [*BUILT_IN_TRACKERS, "mine"]
    assert trackers[0] == "  jsonl       : available (lockstep.tracking.files.JSONLTracker)"
    assert trackers[-1] == f"  mine        : available ({HERE}.MineTracker)"


def test_the_built_in_trackers_go_through_the_public_registration(monkeypatch):
    calls: list[type[GeneralTracker]] = []
    monkeypatch.setattr(registry, "register_tracker_class", calls.append)
    registry._register_built_in_trackers()
    assert [tracker_class.name for tracker_class in calls] == list(BUILT_IN_TRACKERS)


def _mse(outputs, labels, num_items_in_batch=None):
    return nn.functional.mse_loss(outputs, labels, reduction="sum") / num_items_in_batch


@pytest.mark.parametrize("report_to", ["mine", ["mine"]])
def test_the_trainer_reports_to_a_registered_tracker(tmp_path, report_to):
    register_tracker_class(MineTracker)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=4,
        train_sampling_strategy="sequential",
        optim="sgd",
        learning_rate=0.1,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=report_to,
        run_name="tiny",
        disable_tqdm=True,
    )
    assert args.report_to == ["mine"]
    trainer = Trainer(make_model(), args, train_dataset=make_dataset(8), compute_loss_func=_mse)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    tracker = trainer.accelerator.get_tracker("mine")
    trainer.accelerator.end_training()
    assert type(tracker) is MineTracker and tracker.run_name == "tiny" and tracker.finished
    assert tracker.config == args.to_dict()
    history = trainer.state.log_history
    assert [step for step, _ in tracker.records] == [1, 2, 2] == [entry["step"] for entry in history]
    assert [values for _, values in tracker.records] == [
        {key: value for key, value in entry.items() if key != "step"} for entry in history
    ]
    assert [values["learning_rate"] for _, values in tracker.records[:2]] == [0.1, 0.1]
    first_loss = _mse(make_model()(make_dataset(8).tensors[0][:4]), make_dataset(8).tensors[1][:4], 4)
    assert tracker.records[0][1]["loss"] == pytest.approx(first_loss.item(), abs=1e-4)
