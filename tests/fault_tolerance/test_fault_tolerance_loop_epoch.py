"""The loop that reads a fault-tolerant loader keeps an epoch of its own
(lockstep.layers.fault_tolerance.data): a group that heals into a later epoch of the job reads nothing for the
loop epochs the others trained, and meets the job where it stands, with or without ``set_epoch``. The quorum
is played by hand here (one group, one participant); the same under real torchft quorums with a group killed
and relaunched by ``lockstep launch``: tests/e2e/test_fault_tolerance_one_history.py."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils.data import DataLoader

from lockstep.layers.fault_tolerance.data import QuorumDataLoader, quorum_loader

BATCHES = 4
"""Global batches per epoch (the loader's data is 8 ids in batches of 2)."""


def _loader() -> QuorumDataLoader:
    data = DataLoader(torch.arange(2 * BATCHES), batch_size=2)
    return quorum_loader(data, quorum=lambda: (1, 0), groups=1, device=None, data_seed=None, refusals={})


def _epoch(loader: QuorumDataLoader) -> list[int]:
    """One iteration, each batch a committed step; the first id of each batch read."""
    read = []
    for batch in loader:
        read.append(int(batch[0]))
        loader.steps.step_ended(True)
    return read


def _healed(loader: QuorumDataLoader, epoch: int, consumed: int) -> None:
    """What a heal does to the loader: the live peer's position, loaded while receiving from the peer."""
    with loader.steps.receiving_from_peer():
        loader.load_state_dict({"epoch": epoch, "global_batches": consumed})


def test_a_loop_without_set_epoch_skips_the_epochs_a_heal_passed_and_ends_with_the_job(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loader = _loader()
    _healed(loader, epoch=2, consumed=1)  # healed in prepare, before the loop began
    with caplog.at_level(logging.WARNING, logger="lockstep.layers"):
        passes = [_epoch(loader) for _ in range(4)]  # for epoch in range(4): for batch in loader
    assert passes == [[], [], [2, 4, 6], [0, 2, 4, 6]]  # epoch 2 from its second batch, then epoch 3 whole
    assert loader.steps.epoch == 4 and loader.steps.loop_epoch == 4
    warnings = [r.getMessage() for r in caplog.records if "stands at epoch" in r.getMessage()]
    assert warnings == [
        "this replica group stands at epoch 2 of the job (it healed from a live peer) while the loop reading "
        "this loader is at epoch 0: the others trained epochs 0-1 already, so the loop's iterations for them "
        "read nothing here, and its epoch 2 continues where the job stands"
    ]  # once per heal, not once per skipped epoch


def test_set_epoch_behind_the_job_reads_nothing_at_the_job_continues_and_ahead_jumps() -> None:
    loader = _loader()
    _healed(loader, epoch=1, consumed=2)
    loader.set_epoch(0)
    assert _epoch(loader) == []  # the others trained epoch 0
    loader.set_epoch(1)
    assert _epoch(loader) == [4, 6]  # epoch 1 continues where the job stood (not from its start)
    loader.set_epoch(3)
    assert _epoch(loader) == [0, 2, 4, 6] and loader.steps.epoch == 4  # ahead: from epoch 3's start
    with pytest.raises(ValueError, match=r"set_epoch\(-1\) is invalid: pass the loop's epoch, an int >= 0"):
        loader.set_epoch(-1)


def test_a_checkpoint_position_is_where_the_loop_resumes_and_set_epoch_keeps_it() -> None:
    loader = _loader()
    loader.load_state_dict({"epoch": 2, "global_batches": 3})  # load_state: the loop resumes at epoch 2
    assert _epoch(loader) == [6]
    fresh = _loader()
    fresh.load_state_dict({"epoch": 2, "global_batches": 3})
    fresh.set_epoch(2)  # for epoch in range(starting_epoch, n): set_epoch(epoch) keeps the resumed position
    assert _epoch(fresh) == [6]


def test_a_heal_in_the_middle_of_a_pass_continues_the_pass_in_the_job_s_epoch() -> None:
    loader = _loader()
    it = iter(loader)
    assert int(next(it)[0]) == 0
    loader.steps.step_ended(True)
    _healed(loader, epoch=2, consumed=3)  # the group fell behind and healed at its next quorum
    assert [int(batch[0]) for batch in it] == [6]  # the pass joined the quorum: it reads the job's batch
    assert loader.steps.loop_epoch == 1 and loader.steps.epoch == 3
    # The pass read on to the end of epoch 2, so the loop's epochs 1 and 2 read nothing, and its epoch 3 is 3.
    assert [_epoch(loader) for _ in range(3)] == [[], [], [0, 2, 4, 6]]
