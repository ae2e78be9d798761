"""Issue 16, item 2: the best checkpoint is tracked, survives save_total_limit rotation and is loaded at the
end; EarlyStoppingCallback stops at the predicted step; bad metric names are explained at the first
evaluation."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from torch import nn

from lockstep import Trainer, TrainerCallback, TrainingArguments
from lockstep.trainer import EarlyStoppingCallback
from tests.helpers.training import flat_params, make_dataset, make_model


def mse(outputs, labels, num_items_in_batch=None):
    return nn.functional.mse_loss(outputs, labels)


class Scripted:
    """compute_metrics returning the next value of a script as 'score' (one per evaluation)."""

    def __init__(self, values: list[float]) -> None:
        self.values = list(values)
        self.calls = 0

    def __call__(self, prediction) -> dict:
        value = self.values[min(self.calls, len(self.values) - 1)]
        self.calls += 1
        return {"score": value}


class WeightsAt(TrainerCallback):
    """Copies the model's weights at every evaluation, keyed by step."""

    def __init__(self) -> None:
        self.weights: dict[int, torch.Tensor] = {}

    def on_evaluate(self, args, state, control, **kwargs):
        self.weights[state.global_step] = flat_params(kwargs["model"]).clone()


def _trainer(tmp_path, scores: list[float], callbacks=(), **options) -> tuple[Trainer, WeightsAt]:
    settings = {
        "output_dir": str(tmp_path),
        "max_steps": 10,
        "per_device_train_batch_size": 4,
        "optim": "sgd",
        "learning_rate": 0.05,
        "eval_strategy": "steps",
        "eval_steps": 2,
        "save_steps": 2,
        "logging_steps": 100,
        "load_best_model_at_end": True,
        "metric_for_best_model": "score",
        "disable_tqdm": True,
        **options,
    }
    weights = WeightsAt()
    trainer = Trainer(
        make_model(),
        TrainingArguments(**settings),
        train_dataset=make_dataset(64),
        eval_dataset=make_dataset(16, seed=1),
        compute_loss_func=mse,
        compute_metrics=Scripted(scores),
        callbacks=[weights, *callbacks],
    )
    return trainer, weights


def _train(trainer: Trainer) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        trainer.train()
    return out.getvalue()


def test_the_best_checkpoint_survives_rotation_and_is_the_one_loaded(tmp_path):
    trainer, weights = _trainer(tmp_path, [0.5, 0.9, 0.7, 0.6, 0.8], save_total_limit=2)
    printed = _train(trainer)
    state = trainer.state
    assert (state.best_metric, state.best_global_step, state.global_step) == (0.9, 4, 10)
    assert state.best_model_checkpoint == str(tmp_path / "checkpoint-4")
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-4"]
    assert torch.equal(flat_params(trainer.model), weights.weights[4])
    assert not torch.equal(weights.weights[4], weights.weights[10])
    assert "loaded the best model from" in printed and "eval_score=0.9" in printed


def test_a_limit_of_one_keeps_only_the_best_checkpoint_at_the_end(tmp_path):
    trainer, _ = _trainer(tmp_path, [0.1, 0.3, 0.2, 0.2, 0.2], save_total_limit=1)
    _train(trainer)
    assert [p.name for p in tmp_path.glob("checkpoint-*")] == ["checkpoint-4"]


def test_loss_is_the_default_metric_and_lower_is_better(tmp_path):
    trainer, _ = _trainer(tmp_path, [0.0], metric_for_best_model=None)
    assert (trainer.args.metric_for_best_model, trainer.args.greater_is_better) == ("loss", False)
    _train(trainer)
    losses = {e["step"]: e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e}
    best_step = min(losses, key=losses.get)
    assert (trainer.state.best_global_step, trainer.state.best_metric) == (best_step, losses[best_step])


def test_save_strategy_best_saves_only_new_bests(tmp_path):
    trainer, _ = _trainer(
        tmp_path, [0.5, 0.9, 0.7, 0.95, 0.1], save_strategy="best", load_best_model_at_end=False
    )
    _train(trainer)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == [
        "checkpoint-2",
        "checkpoint-4",
        "checkpoint-8",
    ]
    assert trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-8")


def test_early_stopping_stops_at_the_predicted_step(tmp_path):
    # Best 0.9 at step 4; steps 6 and 8 do not beat it: with patience 2 training stops at step 8.
    stopper = EarlyStoppingCallback(early_stopping_patience=2)
    trainer, _ = _trainer(tmp_path, [0.5, 0.9, 0.7, 0.6, 0.99], callbacks=[stopper], max_steps=20)
    _train(trainer)
    assert trainer.state.global_step == 8 and stopper.early_stopping_patience_counter == 2
    assert trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-4")


def test_early_stopping_threshold_counts_small_gains_as_none(tmp_path):
    # 0.55 and 0.58 improve on 0.5 by less than 0.1: patience 2 stops at step 6.
    stopper = EarlyStoppingCallback(early_stopping_patience=2, early_stopping_threshold=0.1)
    trainer, _ = _trainer(tmp_path, [0.5, 0.55, 0.58, 0.9], callbacks=[stopper], max_steps=20)
    _train(trainer)
    assert trainer.state.global_step == 6


def test_early_stopping_needs_load_best_model_at_end(tmp_path):
    trainer, _ = _trainer(tmp_path, [0.5], callbacks=[EarlyStoppingCallback()], load_best_model_at_end=False)
    with pytest.raises(
        ValueError, match=r"EarlyStoppingCallback needs TrainingArguments\(load_best_model_at_end"
    ):
        _train(trainer)
    with pytest.raises(ValueError, match=r"early_stopping_patience=0\) is invalid: it must be >= 1"):
        EarlyStoppingCallback(early_stopping_patience=0)


def test_a_metric_compute_metrics_never_returns_is_named_at_the_first_evaluation(tmp_path):
    trainer, _ = _trainer(tmp_path, [0.5], metric_for_best_model="accuracy")
    with pytest.raises(
        ValueError,
        match=r"metric_for_best_model='accuracy'\): the evaluation returned no 'eval_accuracy'. Its metrics "
        r"are: eval_loss, eval_score\.",
    ):
        _train(trainer)
    assert trainer.state.global_step == 2  # said at the first evaluation
