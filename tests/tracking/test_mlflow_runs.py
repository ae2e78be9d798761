"""MLflow: the variables Accelerate's MLflowTracker reads, nested runs, one run per init_trackers.

Runs go to a real SQLite store under tmp_path and are read back with MLflow's own client.
"""

from __future__ import annotations

import pytest

from lockstep import Accelerator
from lockstep.tracking import MLflowTracker
from tests.helpers.optional import requires

# mlflow 3.17's SQL store uses an option SQLAlchemy 2.1 deprecates; the tracker hides it, the reader here not.
pytestmark = [
    requires("mlflow"),
    pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated"),
]


@pytest.fixture
def clean_mlflow_environment(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in (
        "MLFLOW_TRACKING_URI",
        "MLFLOW_NESTED_RUN",
        "MLFLOW_EXPERIMENT_NAME",
        "MLFLOW_RUN_ID",
        "MLFLOW_TAGS",
    ):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    ("value", "argument", "expected"),
    [
        ("true", False, True),
        ("1", False, True),
        ("TRUE", False, True),
        ("false", True, False),
        ("0", True, False),
    ],
)
def test_mlflow_nested_run_variable_wins_over_the_argument(
    clean_mlflow_environment, value, argument, expected
):
    clean_mlflow_environment.setenv("MLFLOW_NESTED_RUN", value)
    assert MLflowTracker("run", nested_run=argument).nested_run is expected


def test_mlflow_nested_run_defaults_to_the_argument_and_refuses_other_text(clean_mlflow_environment):
    assert MLflowTracker("run").nested_run is False
    assert MLflowTracker("run", nested_run=True).nested_run is True
    clean_mlflow_environment.setenv("MLFLOW_NESTED_RUN", "maybe")
    with pytest.raises(
        ValueError,
        match=r"MLFLOW_NESTED_RUN='maybe' is invalid: it must be true or false \(or 1 or 0\)\. Set it to true "
        r"to start lockstep's MLflow run nested in the active run, or unset it\.",
    ):
        MLflowTracker("run")


def test_mlflow_nested_run_puts_config_and_metrics_in_one_child_run(tmp_path, clean_mlflow_environment):
    import mlflow
    from mlflow import MlflowClient

    store = f"sqlite:///{tmp_path / 'store.db'}"
    clean_mlflow_environment.setenv("MLFLOW_TRACKING_URI", store)  # the parent's store wins over project_dir
    clean_mlflow_environment.setenv("MLFLOW_NESTED_RUN", "true")
    mlflow.set_tracking_uri(store)
    client = MlflowClient(store)
    experiment_id = client.create_experiment("sweep")
    parent = mlflow.start_run(experiment_id=experiment_id, run_name="parent")
    try:
        accelerator = Accelerator(log_with="mlflow", project_dir=str(tmp_path))
        accelerator.init_trackers("sweep", config={"lr": 0.1, "layers": 2})
        tracker = accelerator.get_tracker("mlflow")
        accelerator.log({"loss": 0.5}, step=1)
        child_id = tracker.run_id
        accelerator.end_training()
        assert tracker.nested_run is True
        assert mlflow.active_run().info.run_id == parent.info.run_id  # the parent is the user's to end
    finally:
        mlflow.end_run()
    runs = {run.info.run_id: run for run in client.search_runs([experiment_id])}
    assert set(runs) == {parent.info.run_id, child_id}  # the configuration did not start a third run
    child, parent_run = runs[child_id], runs[parent.info.run_id]
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert child.data.params == {"lr": "0.1", "layers": "2"} and child.data.metrics == {"loss": 0.5}
    assert parent_run.data.params == {} and parent_run.data.metrics == {}
    assert (child.info.status, parent_run.info.status) == ("FINISHED", "FINISHED")


def test_mlflow_config_goes_into_the_one_run_that_was_started(tmp_path, clean_mlflow_environment):
    from mlflow import MlflowClient

    accelerator = Accelerator(log_with="mlflow", project_dir=str(tmp_path))
    accelerator.init_trackers("single", config={"lr": 0.1})
    run_id = accelerator.get_tracker("mlflow").run_id
    accelerator.end_training()
    client = MlflowClient(f"sqlite:///{tmp_path / 'single' / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("single").experiment_id])
    assert (run.info.run_id, run.data.params) == (run_id, {"lr": "0.1"})


def test_mlflow_experiment_name_run_id_and_tags_variables_win(tmp_path, clean_mlflow_environment):
    from mlflow import MlflowClient

    clean_mlflow_environment.setenv("MLFLOW_EXPERIMENT_NAME", "renamed")
    clean_mlflow_environment.setenv("MLFLOW_TAGS", '{"team": "nlp"}')
    first = Accelerator(log_with="mlflow", project_dir=str(tmp_path))
    first.init_trackers("project", init_kwargs={"mlflow": {"tags": {"team": "cv"}}})
    first.log({"loss": 1.0}, step=1)
    run_id = first.get_tracker("mlflow").run_id
    first.end_training()

    clean_mlflow_environment.setenv("MLFLOW_RUN_ID", run_id)  # resume it
    second = Accelerator(log_with="mlflow", project_dir=str(tmp_path))
    second.init_trackers("project")
    second.log({"loss": 0.5}, step=2)
    assert second.get_tracker("mlflow").run_id == run_id
    second.end_training()

    client = MlflowClient(f"sqlite:///{tmp_path / 'project' / 'mlflow.db'}")  # the store stays by project
    assert client.get_experiment_by_name("project") is None
    [run] = client.search_runs([client.get_experiment_by_name("renamed").experiment_id])
    assert run.info.run_id == run_id and run.data.tags["team"] == "nlp"
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == [(1, 1.0), (2, 0.5)]


def test_mlflow_tags_as_text_must_be_a_json_object(clean_mlflow_environment):
    assert MLflowTracker("run", tags='{"team": "nlp"}').tags == {"team": "nlp"}
    clean_mlflow_environment.setenv("MLFLOW_TAGS", "team=nlp")
    with pytest.raises(
        ValueError,
        match=r"MLflow tags 'team=nlp' are invalid: given as text \(tags=\.\.\. or MLFLOW_TAGS\) they must be "
        r"a JSON object such as '\{\"team\": \"nlp\"\}'\. Pass a dict or a JSON object\.",
    ):
        MLflowTracker("run")


def test_mlflow_leaves_an_over_long_value_out_of_its_own_copy_only(
    tmp_path, clean_mlflow_environment, caplog
):
    """Accelerate's test_store_init_configuration_does_not_mutate_input: the value is dropped from the
    MLflow run, and the caller's dict (which every tracker gets) keeps it."""
    import json

    from mlflow import MlflowClient
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    too_long = "x" * (MAX_PARAM_VAL_LENGTH + 1)
    values = {"learning_rate": 0.001, "too_long": too_long}
    accelerator = Accelerator(log_with=["mlflow", "jsonl"], project_dir=str(tmp_path))
    accelerator.init_trackers("drop", config=values)
    run_id = accelerator.get_tracker("mlflow").run_id
    jsonl_folder = accelerator.get_tracker("jsonl").folder
    accelerator.end_training()
    assert values == {"learning_rate": 0.001, "too_long": too_long}
    client = MlflowClient(f"sqlite:///{tmp_path / 'drop' / 'mlflow.db'}")
    assert client.get_run(run_id).data.params == {"learning_rate": "0.001"}
    assert json.loads((jsonl_folder / "config.json").read_text()) == values
    assert f"parameter 'too_long' has {MAX_PARAM_VAL_LENGTH + 1} characters" in caplog.text
