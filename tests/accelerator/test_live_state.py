"""The Accelerator's state a fault-tolerant group heals from a live peer (lockstep.accelerator.live_state),
as plain objects: what it sends, what it loads, and the error when the peer prepared other objects."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from lockstep.accelerator.accumulation import GradientAccumulation
from lockstep.accelerator.live_state import LiveTrainingState
from lockstep.accelerator.prepared import PreparedObjects
from lockstep.data import prepare_data_loader
from lockstep.state import GradientState


def _state(loaders: int, schedulers: int) -> tuple[LiveTrainingState, PreparedObjects]:
    prepared = PreparedObjects()
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=1.0)
    prepared.schedulers = [
        torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5) for _ in range(schedulers)
    ]
    prepared.dataloaders = [
        prepare_data_loader(DataLoader(list(range(8)), batch_size=2)) for _ in range(loaders)
    ]
    return LiveTrainingState(prepared, None, GradientAccumulation(GradientState())), prepared


def test_a_peer_state_moves_positions_schedulers_and_the_counter() -> None:
    peer, peer_objects = _state(loaders=1, schedulers=1)
    batches = iter(peer_objects.dataloaders[0])
    next(batches), next(batches)
    peer_objects.schedulers[0].optimizer.step()
    peer_objects.schedulers[0].step()
    peer.accumulation.step = 3
    here, objects = _state(loaders=1, schedulers=1)
    here.load_positions(peer.positions())
    here.load_state_dict(peer.state_dict())
    assert [batch.tolist() for batch in objects.dataloaders[0]] == [[4, 5], [6, 7]]
    assert objects.schedulers[0].last_epoch == 1 and here.accumulation.step == 3


def test_a_peer_with_other_objects_is_refused_with_the_reason() -> None:
    peer, _ = _state(loaders=0, schedulers=1)
    here, _ = _state(loaders=1, schedulers=1)
    with pytest.raises(
        ValueError, match=r"healed from a live peer that has 0 prepared dataloaders, and it has 1"
    ):
        here.load_positions(peer.positions())
    here, _ = _state(loaders=1, schedulers=0)
    with pytest.raises(
        ValueError,
        match=r"has 1 prepared schedulers, and it has 0 .* prepare\(\) call of its optimizer or before",
    ):
        here.load_state_dict(peer.state_dict())


def test_a_loader_prepared_after_the_heal_takes_the_peer_s_position_then() -> None:
    peer, peer_objects = _state(loaders=1, schedulers=0)
    batches = iter(peer_objects.dataloaders[0])
    next(batches), next(batches)
    here, objects = _state(loaders=0, schedulers=0)
    here.load_positions(peer.positions())  # the heal, before this process prepared its loader
    objects.add_dataloader(prepare_data_loader(DataLoader(list(range(8)), batch_size=2)))
    assert [batch.tolist() for batch in objects.dataloaders[0]] == [[4, 5], [6, 7]]
