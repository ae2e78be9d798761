"""One process behaves like plain PyTorch (issue 15): adding the four lines changes no number.

Without ``use_seedable_sampler``, a one-process prepared loader yields the plain ``DataLoader``'s batches
in the same order and draws from the global generator exactly as it does, so dropout and everything after
match bitwise; an epoch resumed from a checkpoint replays its order without drawing again.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lockstep import Accelerator

SAMPLES, BATCH = 40, 4


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(SAMPLES, 6, generator=generator), torch.randn(SAMPLES, 1, generator=generator)
    )


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 1))


def _run(prepared: bool, epochs: int = 2) -> tuple[list[float], list[list[int]]]:
    torch.manual_seed(1234)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(_data(), batch_size=BATCH, shuffle=True)
    if prepared:
        model, optimizer, loader = Accelerator().prepare(model, optimizer, loader)
    losses, firsts = [], []
    for _ in range(epochs):
        for step, (x, y) in enumerate(loader):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            if step == 0:
                firsts.append(x[:, 0].tolist())
    return losses, firsts


def test_the_four_lines_change_no_loss_on_one_process():
    plain_losses, plain_firsts = _run(prepared=False)
    lockstep_losses, lockstep_firsts = _run(prepared=True)
    assert lockstep_firsts == plain_firsts  # same order, epoch after epoch
    assert lockstep_losses == plain_losses  # bitwise: the global generator is consumed identically


STEPS, STOP = 20, 13  # 10 batches per epoch: the stop falls in the middle of the second epoch


def _prepared(accelerator: Accelerator):
    torch.manual_seed(1234)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    return accelerator.prepare(model, optimizer, DataLoader(_data(), batch_size=BATCH, shuffle=True))


def _train(
    accelerator: Accelerator, model, optimizer, loader, steps: int, stop: int | None = None
) -> list[float]:
    losses: list[float] = []
    while len(losses) < steps:
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            if len(losses) in (steps, stop):
                return losses
    return losses


def test_a_one_process_run_resumed_mid_epoch_ends_bitwise_equal(tmp_path):
    accelerator = Accelerator()
    uninterrupted = _train(accelerator, *_prepared(accelerator), steps=STEPS)
    weights = [p.detach().clone() for p in accelerator._prepared.models[0].parameters()]

    accelerator = Accelerator()
    first_part = _train(accelerator, *_prepared(accelerator), steps=STEPS, stop=STOP)
    accelerator.save_state(str(tmp_path / "ckpt"))

    accelerator = Accelerator()
    model, optimizer, loader = _prepared(accelerator)
    torch.rand(7)  # the new process's own draws before resuming must not matter
    accelerator.load_state(str(tmp_path / "ckpt"))
    resumed = _train(accelerator, model, optimizer, loader, steps=STEPS - STOP)
    assert first_part + resumed == uninterrupted
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), weights))
