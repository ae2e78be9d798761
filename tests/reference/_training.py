"""One small training set-up that both sides of a reference test build: lockstep in its environment, the
real Accelerate in the reference one (this module imports torch only, so both can import it).

``train`` runs the same steps through either library's ``Accelerator`` (lockstep's API is Accelerate's), and
``snapshot`` records what a checkpoint must carry over: weights, optimizer and scheduler state, the custom
object, the step and the next numbers each random generator draws.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import numpy as np
import torch
from torch import nn

FEATURES = 5


class Counter:
    """A custom object registered for checkpointing (``custom_checkpoint_0.pkl``)."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict[str, int]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.count = state["count"]


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any, Counter]:
    """Model, AdamW (its moments make a missed optimizer load visible), StepLR and a counter; ``seed``
    differs between writer and reader so that only a real load makes them equal."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler, Counter()


def train(
    accelerator: Any, model: nn.Module, optimizer: Any, scheduler: Any, counter: Counter, steps: int
) -> None:
    """``steps`` steps on batches drawn from a generator seeded by the step and the process index, so that
    a resumed run sees the batches the uninterrupted one would."""
    for _ in range(steps):
        generator = torch.Generator().manual_seed(1000 * counter.count + accelerator.process_index)
        x = torch.randn(4, FEATURES, generator=generator)
        y = x.sum(dim=1, keepdim=True) * 0.3
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        counter.count += 1


def snapshot(accelerator: Any, model: nn.Module, optimizer: Any, scheduler: Any, counter: Counter) -> dict:
    """What a checkpoint must carry over; draws from every generator (call it once, right after a save or a
    load)."""
    return {
        "setup": [accelerator.num_processes, accelerator.distributed_type.value],
        "model": {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()},
        # copies: AdamW updates its step and moments in place as training goes on
        "optimizer": copy.deepcopy(optimizer.state_dict()),
        "scheduler": copy.deepcopy(scheduler.state_dict()),
        "counter": counter.count,
        "step": accelerator.step,
        "draws": [random.random(), float(np.random.rand()), *torch.rand(2).tolist()],
    }


def assert_same(ours: Any, theirs: Any, path: str = "") -> None:
    """Bitwise equality of two nested states (tensors with ``torch.equal``), naming the first difference."""
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor) and ours.dtype == theirs.dtype, (
            f"{path}: {ours!r} vs {theirs!r}"
        )
        assert torch.equal(ours, theirs), f"{path}: tensors differ, max |diff| {(ours - theirs).abs().max()}"
    elif isinstance(theirs, dict):
        assert isinstance(ours, dict) and set(ours) == set(theirs), f"{path}: keys {ours!r} vs {theirs!r}"
        for key in theirs:
            assert_same(ours[key], theirs[key], f"{path}.{key}")
    elif isinstance(theirs, (list, tuple)):
        assert isinstance(ours, (list, tuple)) and len(ours) == len(theirs), f"{path}: {ours!r} vs {theirs!r}"
        for index, (a, b) in enumerate(zip(ours, theirs)):
            assert_same(a, b, f"{path}[{index}]")
    else:
        assert ours == theirs, f"{path}: {ours!r} vs {theirs!r}"
