"""MLflow runs in a local store under the logging folder (needs ``pip install mlflow-skinny sqlalchemy alembic``).

MLflow 3 refuses new plain-file stores (``./mlruns``) unless ``MLFLOW_ALLOW_FILE_STORE=true``, so the
local store is MLflow's recommended one: a SQLite database, ``logging_dir/run_name/mlflow.db``, with
artifacts in ``logging_dir/run_name/mlartifacts``. Read it back with
``MlflowClient("sqlite:///.../mlflow.db")`` or ``mlflow ui --backend-store-uri sqlite:///.../mlflow.db``.
A ``tracking_uri`` argument (or ``MLFLOW_TRACKING_URI``, which MLflow reads itself) points elsewhere.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lockstep.tracking.base import GeneralTracker, importable, not_started, plain_value

logger = logging.getLogger("lockstep.tracking")

_INSTALL = "pip install mlflow-skinny sqlalchemy alembic"
# What the local SQLite store needs besides mlflow (a remote tracking_uri does not).
_STORE_PACKAGES = ("sqlalchemy", "alembic")


# MLflow's own environment variables that Accelerate's MLflowTracker reads (MLflow reads
# MLFLOW_TRACKING_URI itself). Only this tracker looks at them.
_EXPERIMENT_NAME = "MLFLOW_EXPERIMENT_NAME"
_RUN_ID = "MLFLOW_RUN_ID"
_TAGS = "MLFLOW_TAGS"
_NESTED_RUN = "MLFLOW_NESTED_RUN"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def _nested_run(default: bool) -> bool:
    """``MLFLOW_NESTED_RUN`` as a bool when it is set, else ``default``."""
    text = os.environ.get(_NESTED_RUN)
    if text is None:
        return bool(default)
    if text.strip().lower() in _TRUE:
        return True
    if text.strip().lower() in _FALSE:
        return False
    raise ValueError(
        f"{_NESTED_RUN}={text!r} is invalid: it must be true or false (or 1 or 0). Set it to true to "
        "start lockstep's MLflow run nested in the active run, or unset it."
    )


def _tags(tags: dict[str, Any] | str | None) -> dict[str, Any] | None:
    """The run's tags from a dict or its JSON text (``MLFLOW_TAGS``)."""
    if not isinstance(tags, str):
        return tags
    try:
        parsed = json.loads(tags)
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise ValueError(
            f"MLflow tags {tags!r} are invalid: given as text (tags=... or {_TAGS}) they must be a JSON "
            'object such as \'{"team": "nlp"}\'. Pass a dict or a JSON object.'
        )
    return parsed


def _import_mlflow() -> Any:
    try:
        import mlflow
    except ImportError:
        raise ImportError(f"log_with='mlflow' needs the mlflow package: {_INSTALL}") from None
    return mlflow


@contextlib.contextmanager
def _quiet_store_setup() -> Iterator[None]:
    """Hide what creating a SQLite store prints: migration INFO lines and SQLAlchemy deprecation notes.

    They concern MLflow's own code, which the user cannot act on.
    """
    noisy = [
        logging.getLogger(name) for name in ("mlflow.store.db.utils", "alembic", "alembic.runtime.migration")
    ]
    levels = [log.level for log in noisy]
    for log in noisy:
        log.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", category=DeprecationWarning, module=r"(mlflow|sqlalchemy|alembic)"
            )
            warnings.filterwarnings("ignore", message=r".*``noload`` loader strategy is deprecated")
            yield
    finally:
        for log, level in zip(noisy, levels):
            log.setLevel(level)


def _check_sqlite_store_packages() -> None:
    missing = [name for name in _STORE_PACKAGES if not importable(name)]
    if missing:
        raise ImportError(
            f"log_with='mlflow' keeps its runs in a local SQLite store, which needs {' and '.join(missing)}: "
            f"{_INSTALL} (or pass init_kwargs={{'mlflow': {{'tracking_uri': ...}}}} for a tracking server)."
        )


def default_tracking_uri(folder: Path) -> str:
    """The SQLite store lockstep uses in ``folder``."""
    return "sqlite:///" + str((folder / "mlflow.db").resolve())


class MLflowTracker(GeneralTracker):
    """One MLflow run: the config as parameters, logged numbers as metrics with their step.

    Args:
        experiment_name: the MLflow experiment (the project name given to ``init_trackers``).
            ``MLFLOW_EXPERIMENT_NAME`` has priority over it.
        logging_dir: the project's logging folder; the store goes to ``logging_dir/experiment_name``
            (the name passed here, even when ``MLFLOW_EXPERIMENT_NAME`` renames the experiment).
            None (and no ``tracking_uri``) leaves MLflow's own default or ``MLFLOW_TRACKING_URI``.
        run_id: resume this existing run instead of starting a new one. ``MLFLOW_RUN_ID`` has priority.
        tags: tags of the run, as a dict or its JSON text. ``MLFLOW_TAGS`` (JSON) has priority.
        nested_run: start the run nested in the active one. ``MLFLOW_NESTED_RUN`` (``true``/``false``,
            ``1``/``0``) has priority; the result is the ``nested_run`` attribute.
        run_name: the run's display name.
        description: the run's description.
        tracking_uri: a store or server to use instead of the local SQLite store.

    Nothing is opened until ``start()`` (``init_trackers`` calls it): then the store is set up and the
    run started; the configuration and every metric go to that one run.

    Example:
        >>> accelerator = Accelerator(log_with="mlflow", project_dir="runs")  # doctest: +SKIP
        >>> accelerator.init_trackers("exp", config={"lr": 3e-5},
        ...                           init_kwargs={"mlflow": {"run_name": "baseline"}})  # doctest: +SKIP
    """

    name = "mlflow"
    requires_logging_directory = False
    requires_packages = ("mlflow",)  # enough with a tracking_uri; the local store needs _STORE_PACKAGES
    install_command = _INSTALL

    @classmethod
    def is_available(cls) -> bool:
        """Whether ``mlflow`` and the local SQLite store's packages can be imported: what ``"all"`` needs."""
        return super().is_available() and all(importable(name) for name in _STORE_PACKAGES)

    def __init__(
        self,
        experiment_name: str | None = None,
        logging_dir: str | os.PathLike | None = None,
        run_id: str | None = None,
        tags: dict[str, Any] | str | None = None,
        nested_run: bool = False,
        run_name: str | None = None,
        description: str | None = None,
        *,
        tracking_uri: str | None = None,
    ) -> None:
        project = experiment_name or "Default"
        self.folder = Path(logging_dir) / project if logging_dir is not None else None
        # MLflow's own variables win over the arguments, as in Accelerate's MLflowTracker.
        self.experiment_name = os.environ.get(_EXPERIMENT_NAME) or project
        self.requested_run_id = os.environ.get(_RUN_ID) or run_id
        self.tags = _tags(os.environ.get(_TAGS, tags))
        self.nested_run = _nested_run(nested_run)
        self.run_name = run_name
        self.description = description
        self._tracking_uri = tracking_uri
        self.tracking_uri: str | None = None
        self.active_run: Any = None
        self._dropped: set[str] = set()

    def start(self) -> None:
        """Set up the store and the experiment, and start (or resume) the run."""
        mlflow = _import_mlflow()
        with _quiet_store_setup():
            self.tracking_uri = self._set_tracking_uri(mlflow, self._tracking_uri)
            experiment_id = self._experiment_id(mlflow)
            self.active_run = mlflow.start_run(
                run_id=self.requested_run_id,
                experiment_id=experiment_id,
                run_name=self.run_name,
                nested=self.nested_run,
                tags=self.tags,
                description=self.description,
            )

    def _set_tracking_uri(self, mlflow: Any, tracking_uri: str | None) -> str:
        """Point MLflow at ``tracking_uri``, else ``MLFLOW_TRACKING_URI``, else the local store; return it."""
        from mlflow.environment_variables import MLFLOW_TRACKING_URI

        if tracking_uri is None and MLFLOW_TRACKING_URI.defined:
            tracking_uri = MLFLOW_TRACKING_URI.get()
        if tracking_uri is None and self.folder is not None:
            _check_sqlite_store_packages()
            self.folder.mkdir(parents=True, exist_ok=True)
            tracking_uri = default_tracking_uri(self.folder)
        if tracking_uri is not None:
            # set_tracking_uri also exports MLFLOW_TRACKING_URI to the environment; keep the user's
            # environment as it was, so that later runs and subprocesses do not inherit this run's store.
            previous = MLFLOW_TRACKING_URI.get() if MLFLOW_TRACKING_URI.defined else None
            mlflow.set_tracking_uri(tracking_uri)
            if previous is None:
                MLFLOW_TRACKING_URI.unset()
            else:
                MLFLOW_TRACKING_URI.set(previous)
        return mlflow.get_tracking_uri()

    def _experiment_id(self, mlflow: Any) -> str:
        """The experiment's id, creating it (with artifacts next to the local store) when it is new."""
        client = mlflow.MlflowClient(self.tracking_uri)
        experiment = client.get_experiment_by_name(self.experiment_name)
        if experiment is not None:
            return experiment.experiment_id
        artifacts = None
        if self.folder is not None and self.tracking_uri == default_tracking_uri(self.folder):
            artifacts = (self.folder / "mlartifacts").resolve().as_uri()
        return client.create_experiment(self.experiment_name, artifact_location=artifacts)

    @property
    def run(self) -> Any:
        """The ``mlflow.ActiveRun`` (``run.info.run_id``...)."""
        return self.active_run

    @property
    def tracker(self) -> Any:
        return self.active_run

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Log ``values`` as run parameters. A value longer than MLflow accepts is left out of what is logged,
        with a warning, as Accelerate does; ``values`` itself is not changed (the other trackers get the same
        dict)."""
        import mlflow
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        params: dict[str, str] = {}
        for key, value in values.items():
            text = str(plain_value(value))
            if len(text) > MAX_PARAM_VAL_LENGTH:
                logger.warning(
                    "mlflow: the value of parameter %r has %d characters; MLflow's log_param() accepts at most "
                    "%d, so it was left out of the run's parameters (the other trackers still get it).",
                    key,
                    len(text),
                    MAX_PARAM_VAL_LENGTH,
                )
                continue
            params[key] = text
        items = list(params.items())
        for start in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            mlflow.log_params(dict(items[start : start + MAX_PARAMS_TAGS_PER_BATCH]), run_id=self.run_id)

    @property
    def run_id(self) -> str:
        """The id of the started run."""
        if self.active_run is None:
            raise not_started(self)
        return self.active_run.info.run_id

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log the numbers in ``values`` as metrics at ``step`` (dicts of numbers as ``key/subkey``).

        MLflow metrics are numbers only: other values (text...) are dropped, with one warning per key.
        """
        import mlflow

        metrics = self._metrics(values)
        if metrics:
            mlflow.log_metrics(metrics, step=step, run_id=self.run_id, **kwargs)

    def _metrics(self, values: dict[str, Any], prefix: str = "") -> dict[str, float]:
        metrics: dict[str, float] = {}
        for key, value in values.items():
            value = plain_value(value)
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                metrics.update(self._metrics(value, prefix=f"{name}/"))
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                metrics[name] = float(value)
            elif name not in self._dropped:
                self._dropped.add(name)
                logger.warning(
                    "mlflow: %r = %r (%s) is not a number; MLflow metrics are numbers, so it is not logged there.",
                    name,
                    value,
                    type(value).__name__,
                )
        return metrics

    def log_artifact(self, local_path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Copy one file into the run's artifacts."""
        import mlflow

        mlflow.log_artifact(str(local_path), artifact_path=artifact_path, run_id=self.run_id)

    def log_artifacts(self, local_dir: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Copy a folder's files into the run's artifacts."""
        import mlflow

        mlflow.log_artifacts(str(local_dir), artifact_path=artifact_path, run_id=self.run_id)

    def log_figure(self, figure: Any, artifact_file: str, **save_kwargs: Any) -> None:
        """Save a matplotlib (or plotly) figure into the run's artifacts."""
        import mlflow

        mlflow.log_figure(figure=figure, artifact_file=artifact_file, save_kwargs=save_kwargs or None)

    def finish(self) -> None:
        """End the run (status FINISHED)."""
        import mlflow

        if self.active_run is None:
            return
        active = mlflow.active_run()
        if active is not None and active.info.run_id == self.run_id:
            mlflow.end_run()
        else:
            mlflow.MlflowClient(self.tracking_uri).set_terminated(self.run_id)
