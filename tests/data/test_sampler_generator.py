"""The shuffling sampler consumes its generator exactly as torch's ``RandomSampler`` does (issue 31).

torch draws each ``randperm`` of an epoch when the previous one is used up (and one more, for the
remainder, when the last is), so an epoch broken off early (an early-stopping ``break``) leaves the
generator where it was after the last batch taken, and the next epoch's order follows from there. A
prepared loader must leave the generator in the same place for every ``k`` it is broken off at, though it
reads one batch ahead. Two processes are simulated in one by preparing each rank's loader with its own
generator seeded alike (the ranks' generators are copies of rank 0's at each epoch start): together they
read ``k`` rounds of two global batches, which is what a plain loader reads in ``2 k`` batches.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler

from lockstep.data import prepare_data_loader

SEED = 7


def _loader(samples: int, batch: int, drop_last: bool, num_samples: int | None) -> DataLoader:
    data = list(range(samples))
    generator = torch.Generator().manual_seed(SEED)
    sampler = RandomSampler(data, num_samples=num_samples, generator=generator)
    return DataLoader(data, batch_size=batch, sampler=sampler, drop_last=drop_last)


def _generator(loader: DataLoader) -> torch.Generator:
    """The user's generator (prepare keeps it: it is the one the ranks synchronize)."""
    generator = getattr(loader, "synchronized_generator", None) or loader.sampler.generator
    assert isinstance(generator, torch.Generator)
    return generator


def _read(loader: DataLoader, stop: int | None) -> list[list[int]]:
    batches = []
    for batch in loader:
        batches.append(batch.tolist())
        if len(batches) == stop:
            break
    return batches


CASES = [(10, 3, 10), (12, 3, 12), (10, 2, 10), (10, 3, 25), (10, 4, 23)]  # samples, batch, num_samples


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("samples", "batch", "num_samples"), CASES)
def test_one_process_broken_off_after_every_k_leaves_the_generator_as_pytorch(
    samples: int, batch: int, num_samples: int, drop_last: bool
) -> None:
    length = len(_loader(samples, batch, drop_last, num_samples))
    for k in range(1, length + 1):
        plain = _loader(samples, batch, drop_last, num_samples)
        plain_first = _read(plain, k)
        prepared = prepare_data_loader(
            _loader(samples, batch, drop_last, num_samples), num_processes=1, process_index=0
        )
        assert _read(prepared, k) == plain_first
        assert torch.equal(_generator(prepared).get_state(), _generator(plain).get_state()), f"k={k}"
        assert _read(prepared, None) == _read(plain, None), f"the epoch after a break at k={k}"


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("samples", "batch", "num_samples"), CASES)
def test_two_processes_broken_off_after_every_k_leave_the_generator_as_pytorch(
    samples: int, batch: int, num_samples: int, drop_last: bool
) -> None:
    world = 2
    ranks = [
        prepare_data_loader(
            _loader(samples, batch, drop_last, num_samples), num_processes=world, process_index=r
        )
        for r in range(world)
    ]
    length = len(ranks[0])
    for k in range(1, length + 1):
        ranks = [
            prepare_data_loader(
                _loader(samples, batch, drop_last, num_samples), num_processes=world, process_index=r
            )
            for r in range(world)
        ]
        plain = _loader(samples, batch, drop_last, num_samples)
        # k rounds are 2 k global batches; when there are fewer, the ranks asked past the end: it ran out
        _read(plain, k * world if k * world <= len(plain) else None)
        for rank, prepared in enumerate(ranks):
            _read(prepared, k)
            same = torch.equal(_generator(prepared).get_state(), _generator(plain).get_state())
            assert same, f"rank {rank}, k={k}"
        # and the next epoch: each rank reads its share of the plain loader's next epoch (whole rounds of
        # full batches; the last, padded round is the sharding's business)
        plain_next = _read(plain, None)
        rounds = sum(len(b) == batch for b in plain_next) // world
        for rank, prepared in enumerate(ranks):
            mine = _read(prepared, None)[:rounds]
            assert mine == plain_next[rank::world][:rounds], f"rank {rank}, the epoch after a break at k={k}"


def test_a_whole_epoch_still_draws_the_remainder_permutation() -> None:
    plain, prepared = (
        _loader(10, 3, False, None),
        prepare_data_loader(_loader(10, 3, False, None), num_processes=1),
    )
    assert _read(prepared, None) == _read(plain, None)
    assert torch.equal(_generator(prepared).get_state(), _generator(plain).get_state())
