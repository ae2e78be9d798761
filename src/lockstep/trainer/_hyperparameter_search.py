"""``Trainer.hyperparameter_search`` on Optuna, as transformers runs it, on one or many processes.

Each trial is a fresh run: the trial's hyperparameters are set on a copy of the arguments, ``model_init``
builds the model, and a new Trainer (with its own Accelerator, as transformers re-creates its accelerator
per trial) trains it in ``output_dir/run-<trial number>``. On several processes the main process asks
Optuna for each trial's parameters and broadcasts them, so every rank trains with the same ones; the
others see a ``FixedTrial`` with those parameters. After each evaluation during training the objective is
reported to Optuna by the main process, whose pruning decision is broadcast, so every rank stops a pruned
trial at the same step.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

from lockstep.checkpoint import Location, storage_for
from lockstep.trainer.arguments import TrainingArguments
from lockstep.trainer.callbacks import TrainerCallback, TrainerControl, TrainerState
from lockstep.utils import broadcast_object_list

# The searching lockstep.Trainer; typed loosely because trainer.py imports this module.
Trainer = Any

logger = logging.getLogger("lockstep.trainer")

BACKENDS = ("optuna",)
_SPEED_SUFFIXES = ("_runtime", "_per_second")


class BestRun(NamedTuple):
    """The best run of a hyperparameter search (transformers' ``BestRun``).

    Attributes:
        run_id: the trial number (its checkpoints are in ``output_dir/run-<run_id>``).
        objective: the objective of that run (a list for a multi-objective search).
        hyperparameters: the hyperparameters it was trained with.
        run_summary: not used by the Optuna backend (None).
    """

    run_id: str
    objective: float | list[float]
    hyperparameters: dict[str, Any]
    run_summary: Any | None = None


def default_compute_objective(metrics: dict[str, float]) -> float:
    """transformers' default: the evaluation loss when ``compute_metrics`` gives nothing else, otherwise the sum
    of the metrics (speed metrics and the epoch left out)."""
    metrics = {k: v for k, v in metrics.items() if not k.endswith(_SPEED_SUFFIXES) and k != "epoch"}
    loss = metrics.pop("eval_loss", None)
    return float(loss) if not metrics and loss is not None else float(sum(metrics.values()))


def default_hp_space_optuna(trial: Any) -> dict[str, Any]:
    """transformers' default search space."""
    return {
        "learning_rate": trial.suggest_float("learning_rate", 1e-6, 1e-4, log=True),
        "num_train_epochs": trial.suggest_int("num_train_epochs", 1, 5),
        "seed": trial.suggest_int("seed", 1, 40),
        "per_device_train_batch_size": trial.suggest_categorical(
            "per_device_train_batch_size", [4, 8, 16, 32, 64]
        ),
    }


def import_optuna() -> Any:
    try:
        import optuna
    except ImportError:
        raise ImportError(
            "Trainer.hyperparameter_search(backend='optuna') needs Optuna: pip install 'lockstep[optuna]' (or pip "
            "install optuna)."
        ) from None
    return optuna


def check_backend(backend: Any) -> str:
    name = getattr(backend, "value", backend)
    if name is None:
        return "optuna"
    if name not in BACKENDS:
        raise NotImplementedError(
            f"Trainer.hyperparameter_search(backend={name!r}) is not built in lockstep: the backends are "
            f"{list(BACKENDS)}. Pass backend='optuna' (pip install 'lockstep[optuna]')."
        )
    return str(name)


def call_model_init(model_init: Callable[..., Any], trial: Any) -> Any:
    """``model_init()`` or ``model_init(trial)``, as its signature asks."""
    parameters = inspect.signature(model_init).parameters
    model = model_init() if len(parameters) == 0 else model_init(trial)
    if model is None:
        raise RuntimeError("Trainer(model_init=...) returned None; it must return the model to train.")
    return model


def trial_arguments(args: TrainingArguments, params: dict[str, Any], run_dir: Location) -> TrainingArguments:
    """A copy of ``args`` with the trial's hyperparameters (cast to each field's type, as transformers does)."""
    trial_args = copy.deepcopy(args)
    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    for key, value in params.items():
        if key not in fields:
            raise ValueError(
                f"hyperparameter_search: the search space sets {key!r}, which is not a TrainingArguments field. "
                "Name fields of TrainingArguments (learning_rate, per_device_train_batch_size, ...); model "
                "choices belong in model_init(trial)."
            )
        old = getattr(trial_args, key)
        if old is not None and not isinstance(old, bool) and isinstance(old, (int, float)):
            value = type(old)(value)
        setattr(trial_args, key, value)
    trial_args.output_dir = str(run_dir)
    return trial_args


class _Pruned(Exception):
    """Raised on every rank when the main process's trial is pruned."""


class TrialReporter(TrainerCallback):
    """Reports the objective of each evaluation during training to the trial; stops pruned trials on every
    rank together.

    Args:
        trial: the Optuna trial (a ``FixedTrial`` on processes other than the main one).
        compute_objective: metrics -> objective.
        is_main_process: whether this process holds the real trial.
        num_processes: the number of processes (the pruning decision is broadcast when > 1).
    """

    def __init__(
        self,
        trial: Any,
        compute_objective: Callable[[dict[str, float]], Any],
        *,
        is_main_process: bool,
        num_processes: int,
    ) -> None:
        self.trial = trial
        self.compute_objective = compute_objective
        self.is_main_process = is_main_process
        self.num_processes = num_processes
        self.objective: Any = None
        self.reported: set[int] = set()
        self.training = False

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> Any:
        self.training = True

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> Any:
        self.training = False

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> Any:
        self.objective = self.compute_objective(dict(kwargs.get("metrics") or {}))
        if not self.training or state.global_step in self.reported or isinstance(self.objective, list):
            return control  # Optuna prunes single-objective studies only
        self.reported.add(state.global_step)
        decision = [False]
        if self.is_main_process:
            self.trial.report(self.objective, state.global_step)
            decision[0] = bool(self.trial.should_prune())
        if self.num_processes > 1:
            broadcast_object_list(decision)
        if decision[0]:
            raise _Pruned(f"trial pruned at step {state.global_step}")
        return control


def search(
    trainer: Trainer,
    *,
    hp_space: Callable[[Any], dict[str, Any]] | None,
    compute_objective: Callable[[dict[str, float]], Any] | None,
    n_trials: int,
    direction: str | list[str],
    backend: Any,
    hp_name: Callable[[Any], str] | None,
    study_kwargs: dict[str, Any],
) -> BestRun | list[BestRun]:
    """``Trainer.hyperparameter_search``: check the request, then run it on Optuna."""
    check_backend(backend)
    if trainer.model_init is None:
        raise RuntimeError(
            "Trainer.hyperparameter_search() needs Trainer(model_init=...): each trial trains a new model."
        )
    if isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials < 1:
        raise ValueError(f"hyperparameter_search(n_trials={n_trials!r}) is invalid: pass an int >= 1.")
    directions = direction if isinstance(direction, list) else [direction]
    if not directions or any(d not in ("minimize", "maximize") for d in directions):
        raise ValueError(
            f"hyperparameter_search(direction={direction!r}) is invalid: pass 'minimize', 'maximize' or a list "
            "of them (one per objective)."
        )
    return run_optuna(
        trainer,
        hp_space=hp_space or default_hp_space_optuna,
        compute_objective=compute_objective or default_compute_objective,
        n_trials=n_trials,
        direction=direction,
        hp_name=hp_name,
        study_kwargs=dict(study_kwargs),
    )


def trial_trainer(
    trainer: Trainer, args: TrainingArguments, trial: Any, reporter: TrainerCallback
) -> Trainer:
    """A Trainer for one trial: a new model from ``model_init(trial)``, the searching Trainer's data and
    callbacks (and the reporter)."""
    assert trainer.model_init is not None
    model = call_model_init(trainer.model_init, trial)
    inputs = dict(trainer._inputs)
    inputs["callbacks"] = [*(inputs["callbacks"] or []), reporter]
    return type(trainer)(model, args, model_init=trainer.model_init, **inputs)


def run_optuna(
    trainer: Trainer,
    *,
    hp_space: Callable[[Any], dict[str, Any]],
    compute_objective: Callable[[dict[str, float]], Any],
    n_trials: int,
    direction: str | list[str],
    hp_name: Callable[[Any], str] | None,
    study_kwargs: dict[str, Any],
) -> BestRun | list[BestRun]:
    """Run the search; every process returns the best run(s)."""
    optuna = import_optuna()
    accelerator = trainer.accelerator
    is_main, world = accelerator.is_main_process, accelerator.num_processes
    search = {"timeout": study_kwargs.pop("timeout", None), "catch": study_kwargs.pop("catch", ())}
    directions = direction if isinstance(direction, list) else None
    study = None
    if is_main:
        study = optuna.create_study(
            direction=None if directions else direction, directions=directions, **study_kwargs
        )

    def objective(trial: Any) -> Any:
        params = hp_space(trial)
        return _run_trial(trainer, trial, params, compute_objective, hp_name, is_main, world)

    if is_main:
        assert study is not None
        study.optimize(objective, n_trials=n_trials, **search)
        if world > 1:
            broadcast_object_list([None])  # no more trials
        best = _best_runs(study)
    else:
        while True:
            message: list[Any] = [None]
            broadcast_object_list(message)
            if message[0] is None:
                break
            number, params = message[0]
            fixed = optuna.trial.FixedTrial(params, number)
            try:
                _run_trial(trainer, fixed, params, compute_objective, hp_name, is_main, world, announced=True)
            except optuna.TrialPruned:
                pass
        best = None
    shared = [best]
    if world > 1:
        broadcast_object_list(shared)
    return shared[0]


def _run_trial(
    trainer: Trainer,
    trial: Any,
    params: dict[str, Any],
    compute_objective: Callable[[dict[str, float]], Any],
    hp_name: Callable[[Any], str] | None,
    is_main: bool,
    world: int,
    *,
    announced: bool = False,
) -> Any:
    optuna = import_optuna()
    number = int(getattr(trial, "number", 0))
    if is_main and world > 1 and not announced:
        broadcast_object_list([(number, dict(params))])
    run_dir = storage_for(trainer.args.output_dir).join(trainer.args.output_dir, f"run-{number}")  # URLs too
    reporter = TrialReporter(trial, compute_objective, is_main_process=is_main, num_processes=world)
    trial_run = trial_trainer(trainer, trial_arguments(trainer.args, params, run_dir), trial, reporter)
    trial_run.state.trial_name = hp_name(trial) if hp_name is not None else None
    trial_run.state.trial_params = dict(params)
    try:
        trial_run.train()
        if reporter.objective is None:  # no evaluation during training
            trial_run.evaluate()
    except _Pruned:
        raise optuna.TrialPruned() from None
    finally:
        trial_run.accelerator.free_memory()
    logger.info("trial %d: %s -> objective %s", number, params, reporter.objective)
    return reporter.objective


def _best_runs(study: Any) -> BestRun | list[BestRun]:
    if len(study.directions) == 1:
        best = study.best_trial
        return BestRun(str(best.number), best.value, best.params)
    return [BestRun(str(t.number), t.values, t.params) for t in study.best_trials]
