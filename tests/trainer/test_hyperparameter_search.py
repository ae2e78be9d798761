"""Issue 16 item 7: Trainer.hyperparameter_search on Optuna. On 2 real gloo processes 4 trials find and
return the best one on every rank, every rank trains each trial with the same parameters, and a pruned trial
stops on every rank at the same step."""

from __future__ import annotations

import contextlib
import io

import pytest
from torch import nn

from lockstep import Trainer, TrainerCallback, TrainingArguments
from lockstep.trainer import BestRun
from tests.helpers.multiprocess import run_distributed
from tests.helpers.training import make_dataset, make_model

optuna = pytest.importorskip("optuna")

QUIET = {"LOCKSTEP_DISABLE_PROGRESS_BARS": "1"}
RATES = [0.001, 0.3, 0.03, 0.1]


def mse(outputs, labels, num_items_in_batch=None):
    return nn.functional.mse_loss(outputs, labels)


class Seen(TrainerCallback):
    """Records, per trial, the learning rate each rank trained with and the steps it took."""

    def __init__(self) -> None:
        self.trials: list[dict] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.trials.append({"lr": args.learning_rate, "params": dict(state.trial_params or {}), "steps": 0})

    def on_step_end(self, args, state, control, **kwargs):
        self.trials[-1]["steps"] = state.global_step

    def on_evaluate(self, args, state, control, **kwargs):
        self.trials[-1]["eval_loss"] = kwargs["metrics"]["eval_loss"]


class PruneTrial(optuna.pruners.BasePruner):
    """Prunes one trial (by number) at its first report."""

    def __init__(self, number: int) -> None:
        self.number = number

    def prune(self, study, trial) -> bool:
        return trial.number == self.number


def _search(output_dir: str) -> dict:
    seen = Seen()
    trainer = Trainer(
        args=TrainingArguments(
            output_dir=output_dir,
            max_steps=8,
            per_device_train_batch_size=4,
            optim="sgd",
            lr_scheduler_type="constant",
            eval_strategy="steps",
            eval_steps=4,
            logging_steps=100,
            save_strategy="no",
            disable_tqdm=True,
        ),
        model_init=lambda trial: make_model(),
        train_dataset=make_dataset(64),
        eval_dataset=make_dataset(32, seed=1),
        compute_loss_func=mse,
        callbacks=[seen],
    )
    with contextlib.redirect_stdout(io.StringIO()):
        best = trainer.hyperparameter_search(
            hp_space=lambda trial: {"learning_rate": trial.suggest_categorical("learning_rate", RATES)},
            n_trials=4,
            direction="minimize",
            backend="optuna",
            hp_name=lambda trial: f"trial-{trial.number}",
            sampler=optuna.samplers.GridSampler({"learning_rate": RATES}, seed=0),
            pruner=PruneTrial(number=1),
        )
    return {"best": best, "trials": seen.trials}


@pytest.mark.distributed
def test_four_trials_on_two_processes_find_and_return_the_best_with_the_same_parameters_everywhere(tmp_path):
    results = run_distributed(_search, 2, str(tmp_path), env=QUIET, timeout=180)
    zero, one = results
    assert [t["lr"] for t in zero["trials"]] == [t["lr"] for t in one["trials"]]  # same params on both ranks
    assert sorted(t["lr"] for t in zero["trials"]) == sorted(RATES)  # the grid, each value once
    assert [t["params"] for t in zero["trials"]] == [t["params"] for t in one["trials"]]
    # Trial 1 was pruned at its first evaluation (step 4) on both ranks; the others ran 8 steps.
    assert [t["steps"] for t in zero["trials"]] == [8, 4, 8, 8] == [t["steps"] for t in one["trials"]]
    finished = [t for i, t in enumerate(zero["trials"]) if i != 1]
    winner = min(finished, key=lambda t: t["eval_loss"])
    best = zero["best"]
    assert isinstance(best, BestRun) and best == one["best"]
    assert best.hyperparameters == {"learning_rate": winner["lr"]}
    assert best.objective == pytest.approx(winner["eval_loss"])
    assert best.run_id == str(zero["trials"].index(winner))


def test_hyperparameter_search_refuses_bad_requests(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, disable_tqdm=True, save_strategy="no")
    trainer = Trainer(make_model(), args, train_dataset=make_dataset(8), compute_loss_func=mse)
    with pytest.raises(RuntimeError, match=r"needs Trainer\(model_init=...\)"):
        trainer.hyperparameter_search(n_trials=1)
    trainer = Trainer(
        args=args, model_init=lambda: make_model(), train_dataset=make_dataset(8), compute_loss_func=mse
    )
    with pytest.raises(
        NotImplementedError, match=r"backend='ray'\) is not built in lockstep: the backends are"
    ):
        trainer.hyperparameter_search(backend="ray")
    with pytest.raises(ValueError, match=r"direction='up'\) is invalid"):
        trainer.hyperparameter_search(direction="up")
    with pytest.raises(ValueError, match=r"sets 'hidden', which is not a TrainingArguments field"):
        trainer.hyperparameter_search(
            hp_space=lambda trial: {"hidden": trial.suggest_int("hidden", 1, 2)}, n_trials=1
        )
