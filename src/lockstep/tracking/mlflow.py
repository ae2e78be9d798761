"""MLflow runs in a local store under the logging folder (needs ``pip install mlflow-skinny sqlalchemy alembic``).

MLflow 3 refuses new plain-file stores (``./mlruns``) unless ``MLFLOW_ALLOW_FILE_STORE=true``, so the
local store is MLflow's recommended one: a SQLite database, ``logging_dir/run_name/mlflow.db``, with
artifacts in ``logging_dir/run_name/mlartifacts``. Read it back with
``MlflowClient("sqlite:///.../mlflow.db")`` or ``mlflow ui --backend-store-uri sqlite:///.../mlflow.db``.
A ``tracking_uri`` argument (or ``MLFLOW_TRACKING_URI``, which MLflow reads itself) points elsewhere.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lockstep.tracking.base import GeneralTracker, plain_value

logger = logging.getLogger("lockstep.tracking")

_INSTALL = "pip install mlflow-skinny sqlalchemy alembic"


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
    missing = [name for name in ("sqlalchemy", "alembic") if importlib.util.find_spec(name) is None]
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
        logging_dir: the project's logging folder; the store goes to ``logging_dir/experiment_name``.
            None (and no ``tracking_uri``) leaves MLflow's own default or ``MLFLOW_TRACKING_URI``.
        run_id: resume this existing run instead of starting a new one.
        tags: tags of the run.
        nested_run: start the run nested in the active one.
        run_name: the run's display name.
        description: the run's description.
        tracking_uri: a store or server to use instead of the local SQLite store.

    Example:
        >>> accelerator = Accelerator(log_with="mlflow", project_dir="runs")  # doctest: +SKIP
        >>> accelerator.init_trackers("exp", config={"lr": 3e-5},
        ...                           init_kwargs={"mlflow": {"run_name": "baseline"}})  # doctest: +SKIP
    """

    name = "mlflow"
    requires_logging_directory = False

    def __init__(
        self,
        experiment_name: str | None = None,
        logging_dir: str | os.PathLike | None = None,
        run_id: str | None = None,
        tags: dict[str, Any] | None = None,
        nested_run: bool = False,
        run_name: str | None = None,
        description: str | None = None,
        *,
        tracking_uri: str | None = None,
    ) -> None:
        mlflow = _import_mlflow()
        self.experiment_name = experiment_name or "Default"
        self.folder = Path(logging_dir) / self.experiment_name if logging_dir is not None else None
        with _quiet_store_setup():
            self.tracking_uri = self._set_tracking_uri(mlflow, tracking_uri)
            experiment_id = self._experiment_id(mlflow)
            self.active_run = mlflow.start_run(
                run_id=run_id,
                experiment_id=experiment_id,
                run_name=run_name,
                nested=nested_run,
                tags=tags,
                description=description,
            )
        self._dropped: set[str] = set()

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
        """Log ``values`` as run parameters (long values are cut to MLflow's limit, with a warning)."""
        import mlflow
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        params: dict[str, str] = {}
        for key, value in values.items():
            text = str(plain_value(value))
            if len(text) > MAX_PARAM_VAL_LENGTH:
                logger.warning(
                    "mlflow: the value of parameter %r has %d characters; MLflow keeps %d, so it was cut.",
                    key,
                    len(text),
                    MAX_PARAM_VAL_LENGTH,
                )
                text = text[:MAX_PARAM_VAL_LENGTH]
            params[key] = text
        items = list(params.items())
        for start in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            mlflow.log_params(dict(items[start : start + MAX_PARAMS_TAGS_PER_BATCH]), run_id=self.run_id)

    @property
    def run_id(self) -> str:
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

        active = mlflow.active_run()
        if active is not None and active.info.run_id == self.run_id:
            mlflow.end_run()
        else:
            mlflow.MlflowClient(self.tracking_uri).set_terminated(self.run_id)
