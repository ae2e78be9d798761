"""Train/eval mode of a pipelined model with dropout and BatchNorm, against plain PyTorch on one process.

A tiny MLP (two blocks of Linear, BatchNorm1d, ReLU, Dropout) is cut into 2 stages on 2 gloo processes
(GPipe, and 1F1B, 4 micro-batches of 4). The reference runs the same weights in plain PyTorch, micro-batch by
micro-batch (BatchNorm normalises each micro-batch with its own statistics, as the stages do), with SGD.

Dropout and random numbers: each stage draws its masks from the generator of the rank that holds it, one
micro-batch after the other (with several stages per rank, they share it in the order the schedule runs
them). Plain PyTorch draws every stage's mask from one generator, stage after stage
within each micro-batch, so with dropout in both stages the masks cannot be the same. What is guaranteed,
and tested: with dropout in the first stage only the losses are plain PyTorch's (one generator, the same
draws); with dropout in both, they are those of plain PyTorch with one generator per stage, each seeded as
its rank's (so a seeded run is reproducible).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from lockstep import Accelerator, ParallelismConfig
from lockstep.backends.pp.backend import _warn_random_operators
from lockstep.backends.pp.modes import (
    copy_modes,
    follow_module_modes,
    traced_in_training,
    training_only_suspects,
)
from lockstep.backends.pp.split import trace_stages
from lockstep.config.pipeline import TorchPipelineParallelConfig
from tests.helpers.multiprocess import run_distributed

BATCH, MICRO, FEATURES, WIDTH, SEED, LR = 16, 4, 4, 16, 1234, 0.1
TRAIN_STEPS = (2, 1)  # steps before the first evaluation, and between the second and the third
TOLERANCE = 1e-6


def _make_model(dropout: tuple[float, float]) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.BatchNorm1d(WIDTH), nn.ReLU(), nn.Dropout(dropout[0])),
        nn.Sequential(
            nn.Linear(WIDTH, WIDTH),
            nn.BatchNorm1d(WIDTH),
            nn.ReLU(),
            nn.Dropout(dropout[1]),
            nn.Linear(WIDTH, 1),
        ),
    )


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(sum(TRAIN_STEPS)):
        x = torch.randn(BATCH, FEATURES, generator=generator) * 2 + 1  # BatchNorm has stats to learn
        batches.append((x, x.sum(dim=1, keepdim=True) * 0.3))
    return batches


def _eval_inputs() -> torch.Tensor:
    return torch.randn(BATCH, FEATURES, generator=torch.Generator().manual_seed(8)) * 2 + 1


def _modes(model: nn.Module) -> set[bool]:
    return {module.training for stage in model.stage_modules for module in stage.modules()}


def _pipelined(dropout: tuple[float, float], schedule: str = "gpipe") -> dict:
    handler = TorchPipelineParallelConfig(
        schedule=schedule,
        num_microbatches=BATCH // MICRO,
        split_points=["1"],
        example_args=(torch.zeros(BATCH, FEATURES),),
        loss_fn=nn.functional.mse_loss,
    )
    accelerator = Accelerator(parallelism_config=ParallelismConfig(pp_size=2, pp_handler=handler))
    model = _make_model(dropout)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)
    batches, x_eval, result = iter(_batches()), _eval_inputs(), {"losses": [], "evals": [], "modes": []}

    def evaluate() -> None:
        model.eval()
        result["modes"].append(_modes(model))
        with torch.no_grad():
            result["evals"].append(model(x_eval))
        model.train()
        result["modes"].append(_modes(model))

    def train(steps: int) -> None:
        for _ in range(steps):
            x, y = next(batches)
            loss = accelerator.pipeline_step(model, x, target=y)
            optimizer.step()
            optimizer.zero_grad()
            result["losses"].append(None if loss is None else float(loss))

    torch.manual_seed(SEED)  # every rank: each draws its own stage's dropout masks from it
    evaluate()
    train(TRAIN_STEPS[0])
    evaluate()  # the schedule infers the shapes again at each switch between training and evaluation
    train(TRAIN_STEPS[1])
    evaluate()
    result["state"] = accelerator.get_state_dict(model)
    return result


@contextmanager
def _own_generator(module: nn.Module, seed: int | None) -> Iterator[None]:
    """``module`` draws its random numbers from a generator of its own seeded with ``seed`` (None: the
    global one), as a stage on its own rank does."""
    if seed is None:
        yield
        return
    saved_state = {"state": torch.Generator().manual_seed(seed).get_state()}

    def swap_in(*_: object) -> None:
        saved_state["outer"] = torch.get_rng_state()
        torch.set_rng_state(saved_state["state"])

    def swap_out(*_: object) -> None:
        saved_state["state"] = torch.get_rng_state()
        torch.set_rng_state(saved_state["outer"])

    handles = [module.register_forward_pre_hook(swap_in), module.register_forward_hook(swap_out)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _reference(dropout: tuple[float, float], *, generator_per_stage: bool) -> dict:
    """Plain PyTorch, one process: each micro-batch forward and backward in turn, SGD after each batch."""
    model = _make_model(dropout)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    batches, x_eval, result = iter(_batches()), _eval_inputs(), {"losses": [], "evals": []}
    seeds = (SEED, SEED) if generator_per_stage else (None, None)

    def evaluate() -> None:
        model.eval()
        with torch.no_grad():
            result["evals"].append(model(x_eval))
        model.train()

    def train(steps: int) -> None:
        for _ in range(steps):
            x, y = next(batches)
            losses = []
            for xs, ys in zip(x.split(MICRO), y.split(MICRO), strict=True):
                loss = nn.functional.mse_loss(model(xs), ys)
                (loss / (BATCH // MICRO)).backward()
                losses.append(loss.detach())
            optimizer.step()
            optimizer.zero_grad()
            result["losses"].append(float(torch.stack(losses).mean()))

    torch.manual_seed(SEED)
    with _own_generator(model[0], seeds[0]), _own_generator(model[1], seeds[1]):
        evaluate()
        train(TRAIN_STEPS[0])
        evaluate()
        train(TRAIN_STEPS[1])
        evaluate()
    result["state"] = model.state_dict()
    return result


def _compare(results: list[dict], reference: dict) -> None:
    first, last = results
    steps = sum(TRAIN_STEPS)
    assert first["losses"] == [None] * steps  # the loss lives on the last stage's rank
    assert last["losses"] == pytest.approx(reference["losses"], abs=TOLERANCE, rel=0)
    state, expected = first["state"], reference["state"]
    assert sorted(state) == sorted(expected)
    for key in expected:  # weights, and BatchNorm's running_mean, running_var, num_batches_tracked
        assert (state[key].double() - expected[key].double()).abs().max().item() <= TOLERANCE, key
    assert int(state["0.1.num_batches_tracked"]) == steps * BATCH // MICRO
    for result in results:  # every stage module switched, on both ranks
        assert result["modes"] == [{False}, {True}] * 3
        for got, expected in zip(result["evals"], reference["evals"], strict=True):
            assert (got - expected).abs().max().item() <= TOLERANCE


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_train_and_eval_switch_dropout_and_batch_norm_as_plain_pytorch(schedule):
    dropout = (0.3, 0.0)  # dropout in the first stage only: plain PyTorch draws the same masks
    results = run_distributed(_pipelined, 2, dropout, schedule, timeout=120)
    _compare(results, _reference(dropout, generator_per_stage=False))


@pytest.mark.distributed
def test_dropout_in_every_stage_draws_from_each_ranks_generator():
    dropout = (0.3, 0.5)
    results = run_distributed(_pipelined, 2, dropout, timeout=120)
    _compare(results, _reference(dropout, generator_per_stage=True))
    one_generator = _reference(dropout, generator_per_stage=False)["losses"]
    assert results[1]["losses"] != pytest.approx(one_generator, abs=1e-3)  # why it cannot be plain PyTorch's


def _frozen_norm(model: nn.Sequential) -> nn.Sequential:
    model.train()
    model[1][1].eval()  # a BatchNorm the user froze: running statistics, no updates
    return model


@pytest.mark.parametrize("interpreter", [True, False], ids=["interpreter", "generated_code"])
def test_traced_stages_follow_the_mode_of_their_modules(interpreter):
    model = _frozen_norm(_make_model((0.3, 0.5)))
    reference = _frozen_norm(_make_model((0.3, 0.5)))
    with traced_in_training(model):
        stages = trace_stages(model, (torch.zeros(MICRO, FEATURES),), ["1"])
    assert (model.training, model[1][1].training) == (True, False)  # the user's modes are left as they were
    assert follow_module_modes(stages) == [
        "0.1: aten.add_.Tensor",
        "0.1: aten.batch_norm.default",
        "0.3: aten.dropout.default",
        "1.1: aten.add_.Tensor",
        "1.1: aten.batch_norm.default",
        "1.3: aten.dropout.default",
    ]
    copy_modes(model, stages)
    assert [name for stage in stages for name, m in stage.named_modules() if not m.training] == ["1.1"]
    for module in (m for stage in stages for m in stage.modules()):
        module._run_with_interpreter = interpreter  # InterpreterModule's two ways to run its graph
    x = _eval_inputs()
    for mode in ("train", "eval"):  # dropout drawn alike and BatchNorm updating; then neither
        if mode == "eval":
            for module in (*stages, reference):
                module.eval()
        torch.manual_seed(0)
        got = stages[1](stages[0](x))
        torch.manual_seed(0)
        assert torch.equal(got, reference(x)), mode
    for key, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    assert int(model[0][1].num_batches_tracked) == 1 and int(model[1][1].num_batches_tracked) == 0


def _norms() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(FEATURES, 8),
        nn.Unflatten(1, (2, 4)),
        nn.InstanceNorm1d(2, track_running_stats=True),  # running statistics in eval mode
        nn.Flatten(),
        nn.BatchNorm1d(8, track_running_stats=False),  # the batch's statistics in both modes
        nn.Linear(8, 1),
    )


def test_instance_norm_and_norms_without_running_statistics_follow_pytorch():
    model, reference = _norms(), _norms()
    with traced_in_training(model):
        stages = trace_stages(model, (torch.zeros(MICRO, FEATURES),), ["4"])
    assert follow_module_modes(stages) == ["2: aten.instance_norm.default", "4: aten.batch_norm.default"]
    x = _eval_inputs()
    for mode in ("train", "eval"):
        if mode == "eval":
            for module in (*stages, reference):
                module.eval()
        assert (stages[1](stages[0](x)) - reference(x)).abs().max().item() <= TOLERANCE, mode
    assert torch.equal(model[2].running_mean, reference[2].running_mean)


class _NoisyInTraining(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.1 * torch.randn_like(x) if self.training else x


def test_random_numbers_outside_dropout_are_warned_about():
    noisy = nn.Sequential(nn.Linear(FEATURES, 8), _NoisyInTraining(), nn.Dropout(0.2), nn.Linear(8, 1))
    with traced_in_training(noisy):
        stages = trace_stages(noisy, (torch.zeros(MICRO, FEATURES),), ["3"])
    assert training_only_suspects(stages) == ["1: aten.randn_like.default"]  # dropout is not a suspect
    with pytest.warns(UserWarning) as caught:
        _warn_random_operators(noisy, stages)
    assert str(caught[0].message).startswith(
        "The pipeline stages of Sequential draw random numbers outside dropout (1: aten.randn_like.default). "
        "The model is traced in training mode, so if its forward draws them only when self.training, they "
        "are drawn after model.eval() too"
    )
    with traced_in_training(model := _make_model((0.3, 0.5))):
        assert training_only_suspects(trace_stages(model, (torch.zeros(MICRO, FEATURES),), ["1"])) == []
