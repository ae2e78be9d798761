"""Issue 16, item 3: every lr_scheduler_type follows its published formula at every step (and transformers'
own curve where installed), lr_scheduler_kwargs reach it, and the optim menu builds torch's optimizers."""

from __future__ import annotations

import contextlib
import io
import math

import pytest
import torch
from torch import nn

from lockstep import Trainer, TrainingArguments
from lockstep.trainer.optimizers import create_optimizer
from lockstep.trainer.schedules import get_scheduler
from tests.helpers.training import make_dataset, make_model

STEPS, WARMUP, LR = 20, 4, 1.0


def _linear_warmup(t: int) -> float:
    return t / WARMUP


def _formula(name: str, kwargs: dict):
    """The multiplier at step t, written from transformers' documented formulas."""

    def cosine_progress(t: int) -> float:
        return (t - WARMUP) / (STEPS - WARMUP)

    def f(t: int) -> float:
        if name == "constant":
            return 1.0
        if name == "reduce_lr_on_plateau":
            return 1.0
        if name == "cosine_warmup_with_min_lr":
            rate = kwargs["min_lr_rate"]
            if t < WARMUP:
                return (t + 1) / WARMUP
            p = (t - WARMUP + 1) / (STEPS - WARMUP)
            return max(0.0, 0.5 * (1 + math.cos(math.pi * 2 * 0.5 * p)) * (1 - rate) + rate)
        if name == "warmup_stable_decay":
            decay, floor = kwargs["num_decay_steps"], kwargs["min_lr_ratio"]
            stable = STEPS - WARMUP - decay
            if t < WARMUP:
                return t / WARMUP * (1 - floor) + floor
            if t < WARMUP + stable:
                return 1.0
            if t < STEPS:
                return (1 - (t - WARMUP - stable) / decay) * (1 - floor) + floor  # decay_type linear
            return floor
        if t < WARMUP:
            return _linear_warmup(t)
        p = cosine_progress(t)
        if name == "constant_with_warmup":
            return 1.0
        if name == "linear":
            return max(0.0, (STEPS - t) / (STEPS - WARMUP))
        if name == "cosine":
            return max(0.0, 0.5 * (1 + math.cos(math.pi * 2 * kwargs.get("num_cycles", 0.5) * p)))
        if name == "cosine_with_restarts":
            return 0.0 if p >= 1 else 0.5 * (1 + math.cos(math.pi * ((kwargs["num_cycles"] * p) % 1)))
        if name == "polynomial":
            end, power = kwargs["lr_end"], kwargs["power"]
            if t > STEPS:
                return end / LR
            return ((LR - end) * (1 - p) ** power + end) / LR
        if name == "inverse_sqrt":
            scale = kwargs["timescale"]
            return 1 / math.sqrt((t + scale - WARMUP) / scale)
        if name == "cosine_with_min_lr":
            rate = kwargs["min_lr_rate"]
            return max(0.0, 0.5 * (1 + math.cos(math.pi * p)) * (1 - rate) + rate)
        raise AssertionError(name)

    return f


SCHEDULES = [
    ("linear", {}),
    ("cosine", {}),
    ("cosine", {"num_cycles": 1.5}),
    ("cosine_with_restarts", {"num_cycles": 3}),
    ("polynomial", {"lr_end": 0.1, "power": 2.0}),
    ("constant", {}),
    ("constant_with_warmup", {}),
    ("inverse_sqrt", {"timescale": 7}),
    ("reduce_lr_on_plateau", {}),
    ("cosine_with_min_lr", {"min_lr_rate": 0.1}),
    ("cosine_warmup_with_min_lr", {"min_lr_rate": 0.2}),
    ("warmup_stable_decay", {"num_decay_steps": 6, "min_lr_ratio": 0.1, "decay_type": "linear"}),
]


def _curve(get, name: str, kwargs: dict) -> list[float]:
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=LR)
    scheduler = get(name, optimizer, WARMUP, STEPS, scheduler_specific_kwargs=dict(kwargs))
    rates = [optimizer.param_groups[0]["lr"]]
    for _ in range(STEPS + 2):
        optimizer.step()
        scheduler.step(1.0) if name == "reduce_lr_on_plateau" else scheduler.step()
        rates.append(optimizer.param_groups[0]["lr"])
    return rates


@pytest.mark.parametrize(("name", "kwargs"), SCHEDULES, ids=[f"{n}{k or ''}" for n, k in SCHEDULES])
def test_every_schedule_follows_its_formula_at_every_step(name, kwargs):
    rates = _curve(get_scheduler, name, kwargs)
    formula = _formula(name, kwargs)
    expected = [LR * formula(t) for t in range(STEPS + 3)]
    if name == "reduce_lr_on_plateau":  # a constant metric: patience 10 steps, then x0.1
        expected = [LR if t <= 11 else LR * 0.1 for t in range(STEPS + 3)]
    assert rates == pytest.approx(expected, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize(("name", "kwargs"), SCHEDULES, ids=[f"{n}{k or ''}" for n, k in SCHEDULES])
def test_every_schedule_matches_transformers_curve(name, kwargs):
    optimization = pytest.importorskip("transformers.optimization")
    assert _curve(get_scheduler, name, kwargs) == _curve(optimization.get_scheduler, name, kwargs)


def test_schedule_arguments_are_checked():
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1e-3)
    with pytest.raises(ValueError, match=r"lr_end=0.01: lr_end must be below the learning rate \(0.001\)"):
        get_scheduler("polynomial", optimizer, 0, 10, {"lr_end": 0.01})
    with pytest.raises(ValueError, match=r"needs exactly one of min_lr and min_lr_rate"):
        get_scheduler("cosine_with_min_lr", optimizer, 0, 10)
    with pytest.raises(ValueError, match=r"warmup_type='square': use one of linear, cosine, 1-sqrt"):
        get_scheduler(
            "warmup_stable_decay", optimizer, 0, 10, {"num_decay_steps": 2, "warmup_type": "square"}
        )
    with pytest.raises(
        ValueError, match=r"get_scheduler\('step'\): unknown schedule; use one of linear, cosine"
    ):
        get_scheduler("step", optimizer, 0, 10)


def _logged_rates(tmp_path, **options) -> list[float]:
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=12,
        per_device_train_batch_size=4,
        learning_rate=0.01,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        **options,
    )
    trainer = Trainer(make_model(), args, train_dataset=make_dataset(64), compute_loss_func=_mse)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    return [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e]


def _mse(outputs, labels, num_items_in_batch=None):
    return nn.functional.mse_loss(outputs, labels)


def test_the_trainer_passes_warmup_and_lr_scheduler_kwargs_to_the_schedule(tmp_path):
    rates = _logged_rates(
        tmp_path,
        lr_scheduler_type="cosine_with_restarts",
        lr_scheduler_kwargs={"num_cycles": 2},
        warmup_steps=0.25,
    )
    warmup = 3  # ceil(0.25 * 12)
    expected = []
    for t in range(12):  # the rate logged for step t + 1 is the one it used: the schedule's value at t
        p = (t - warmup) / (12 - warmup)
        expected.append(
            0.01
            * (t / warmup if t < warmup else 0.0 if p >= 1 else 0.5 * (1 + math.cos(math.pi * ((2 * p) % 1))))
        )
    assert rates == pytest.approx(expected, abs=1e-15)


def test_reduce_lr_on_plateau_is_stepped_with_the_evaluated_metric(tmp_path):
    class Flat:
        def __call__(self, prediction):
            return {"score": 1.0}

    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=8,
        per_device_train_batch_size=4,
        learning_rate=0.01,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="steps",
        eval_steps=2,
        metric_for_best_model="score",
        lr_scheduler_type="reduce_lr_on_plateau",
        lr_scheduler_kwargs={"patience": 1, "factor": 0.5},
        disable_tqdm=True,
    )
    trainer = Trainer(
        make_model(),
        args,
        train_dataset=make_dataset(64),
        eval_dataset=make_dataset(8, seed=1),
        compute_loss_func=_mse,
        compute_metrics=Flat(),
    )
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    rates = [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e]
    # Evaluations at steps 2, 4, 6, 8 see no improvement after the first; patience 1 halves the rate after
    # the evaluation at step 6, so steps 7 and 8 use half of it.
    assert rates == pytest.approx([0.01] * 6 + [0.005] * 2)


@pytest.mark.parametrize(
    ("optim", "optim_args", "kind", "defaults"),
    [
        ("adamw_torch", None, torch.optim.AdamW, {"fused": None, "betas": (0.8, 0.99)}),
        ("adamw_torch_fused", None, torch.optim.AdamW, {"fused": True}),
        ("adafactor", "beta2_decay=-0.5", torch.optim.Adafactor, {"beta2_decay": -0.5}),
        ("sgd", "momentum=0.9,nesterov=true", torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
        ("adagrad", "lr_decay=0.01", torch.optim.Adagrad, {"lr_decay": 0.01}),
        ("rmsprop", "alpha=0.9,centered=true", torch.optim.RMSprop, {"alpha": 0.9, "centered": True}),
    ],
)
def test_the_optim_menu_builds_torch_optimizers_with_optim_args(optim, optim_args, kind, defaults):
    args = TrainingArguments(
        optim=optim,
        optim_args=optim_args,
        learning_rate=0.003,
        adam_beta1=0.8,
        adam_beta2=0.99,
        weight_decay=0.1,
    )
    optimizer = create_optimizer(make_model(), args)
    assert type(optimizer) is kind and optimizer.defaults["lr"] == 0.003
    assert {key: optimizer.defaults[key] for key in defaults} == defaults
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
