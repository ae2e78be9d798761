"""Sharding arithmetic and single-process behaviour of the prepared dataloaders (no process group)."""

from __future__ import annotations

import io
import itertools
import time

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler

from lockstep.data import (
    BatchSamplerShard,
    DataLoaderShard,
    IterableDatasetShard,
    SeedableRandomSampler,
    prepare_data_loader,
    skip_first_batches,
)
from lockstep.data._sharding import ShardSpec, simulate_shard
from lockstep.data.samplers import epoch_indices
from lockstep.state import GradientState

SIZES = range(1, 41)
BATCH_SIZES = range(1, 6)
MODES = list(itertools.product((1, 2, 3), (False, True), (False, True), (False, True)))


def accelerate_len(num_batches: int, world: int, rank: int, split: bool, even: bool, drop_last: bool) -> int:
    """Accelerate's BatchSamplerShard.__len__, written out independently of the code under test."""
    if split:
        return num_batches
    if num_batches % world == 0:
        return num_batches // world
    length = num_batches // world
    if drop_last:
        return length
    if even:
        return length + 1
    return length + 1 if rank < num_batches % world else length


def rounds(per_rank: list[list[list[int]]]) -> list[list[int]]:
    """Round k = rank 0's batch k + rank 1's batch k + ... (ranks without a batch k add nothing)."""
    longest = max(len(batches) for batches in per_rank)
    return [[i for batches in per_rank if k < len(batches) for i in batches[k]] for k in range(longest)]


def flatten_truncated(all_rounds: list[list[int]], remainder: int) -> list[int]:
    if not all_rounds:
        return []
    return [i for r in all_rounds[:-1] for i in r] + all_rounds[-1][:remainder]


def expected_samples(size: int, batch: int, world: int, split: bool, drop_last: bool) -> list[int]:
    if not drop_last:
        return list(range(size))
    kept = (size // batch) * batch if split else (size // batch // world) * world * batch
    return list(range(kept))


@pytest.mark.parametrize(("world", "split", "even", "drop_last"), MODES)
def test_batch_sampler_shard_exhaustive(world, split, even, drop_last):
    for size, batch in itertools.product(SIZES, BATCH_SIZES):
        if split and batch % world:
            continue
        global_batches = list(BatchSampler(SequentialSampler(range(size)), batch, drop_last))
        shards = [
            BatchSamplerShard(
                BatchSampler(SequentialSampler(range(size)), batch, drop_last), world, r, split, even
            )
            for r in range(world)
        ]
        per_rank = [list(shard) for shard in shards]
        case = (size, batch, world, split, even, drop_last)
        for rank, (shard, batches) in enumerate(zip(shards, per_rank)):
            spec = ShardSpec(
                world_size=world,
                rank=rank,
                split_batches=split,
                even_batches=even,
                drop_last=drop_last,
                batch_size=batch,
            )
            assert batches == simulate_shard(global_batches, spec), case
            assert len(shard) == len(batches), case
            formula = accelerate_len(len(global_batches), world, rank, split, even, drop_last)
            tail = size % batch
            empty_slice = split and not even and not drop_last and tail and tail <= (batch // world) * rank
            assert len(batches) == formula - (1 if empty_slice else 0), case
            for start in range(len(batches) + 1):
                shard.start_batch = start
                assert list(shard) == batches[start:], (case, start)
                assert len(shard) == len(batches) - start
        if even:
            assert len({len(b) for b in per_rank}) == 1, case
            assert {len(x) for b in per_rank for x in b} <= {batch // world if split else batch}, case
        remainders = {shard.remainder for shard in shards}
        assert len(remainders) == 1, case
        got = flatten_truncated(rounds(per_rank), remainders.pop())
        assert got == expected_samples(size, batch, world, split, drop_last), case


@pytest.mark.parametrize(
    ("world", "split", "drop_last"), list(itertools.product((1, 2, 3), (False, True), (False, True)))
)
def test_iterable_dataset_shard_exhaustive(world, split, drop_last):
    for size, batch in itertools.product(range(0, 41), BATCH_SIZES):
        if split and batch % world:
            continue
        shards = [IterableDatasetShard(range(size), batch, drop_last, world, r, split) for r in range(world)]
        items = [list(shard) for shard in shards]
        per_process = batch // world if split else batch
        case = (size, batch, world, split, drop_last)
        for shard, mine in zip(shards, items):
            assert len(shard) == len(mine), case
        assert len({len(mine) for mine in items}) == 1, case
        per_rank = [[mine[i : i + per_process] for i in range(0, len(mine), per_process)] for mine in items]
        remainders = {shard.remainder for shard in shards}
        assert len(remainders) == 1, case
        round_size = batch if split else batch * world
        kept = size if not drop_last else (size // round_size) * round_size
        assert flatten_truncated(rounds(per_rank), remainders.pop()) == list(range(kept)), case


@pytest.mark.parametrize(
    ("size", "rank0", "rank1", "remainder"),
    [
        (
            24,
            [[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19, 20]],
            [[3, 4, 5], [9, 10, 11], [15, 16, 17], [21, 22, 23]],
            6,
        ),
        (
            21,
            [[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19, 20]],
            [[3, 4, 5], [9, 10, 11], [15, 16, 17], [0, 1, 2]],
            3,
        ),
        (
            22,
            [[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19, 20]],
            [[3, 4, 5], [9, 10, 11], [15, 16, 17], [21, 0, 1]],
            4,
        ),
        (
            20,
            [[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19, 0]],
            [[3, 4, 5], [9, 10, 11], [15, 16, 17], [1, 2, 3]],
            2,
        ),
        (2, [[0, 1, 0]], [[1, 0, 1]], 2),
    ],
)
def test_no_split_even_pinned(size, rank0, rank1, remainder):
    """The cases of Accelerate's own test suite (batch size 3, two processes)."""
    shards = [
        BatchSamplerShard(BatchSampler(SequentialSampler(range(size)), 3, False), 2, r) for r in range(2)
    ]
    assert [list(s) for s in shards] == [rank0, rank1]
    assert shards[0].remainder == remainder


def test_split_pinned():
    def shards(size: int, even: bool = True) -> list[list[list[int]]]:
        inner = BatchSampler(SequentialSampler(range(size)), 4, False)
        return [list(BatchSamplerShard(inner, 2, r, split_batches=True, even_batches=even)) for r in range(2)]

    assert shards(8) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert shards(9) == [[[0, 1], [4, 5], [8, 0]], [[2, 3], [6, 7], [1, 2]]]
    assert shards(9, even=False) == [[[0, 1], [4, 5], [8]], [[2, 3], [6, 7]]]
    assert shards(1) == [[[0, 0]], [[0, 0]]]


class ListBatches(list):
    batch_size = 2
    drop_last = False


def test_irregular_batches_follow_accelerate_stream():
    """A custom batch sampler with a short batch in the middle: Accelerate skips that round."""
    custom = ListBatches([[0, 1], [2], [3, 4], [5, 6], [7]])
    shards = [BatchSamplerShard(custom, 2, r, even_batches=False) for r in range(2)]
    assert [list(s) for s in shards] == [[[3, 4], [7]], [[5, 6]]]
    assert shards[0].remainder == -1
    stale = ListBatches([[0, 1], [2], [3, 4]])
    assert [list(BatchSamplerShard(stale, 2, r, even_batches=False)) for r in range(2)] == [[[3, 4]], [[2]]]


def test_epoch_indices_match_sampler_iteration_and_generator_use():
    for num_samples in (None, 7, 10, 23):
        first, second = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
        expected = list(RandomSampler(range(10), num_samples=num_samples, generator=first))
        fast = epoch_indices(RandomSampler(range(10), num_samples=num_samples, generator=second))
        assert fast[:].tolist() == expected
        fast.touch(len(fast))  # the iteration above asked for one index past the end
        assert torch.equal(first.get_state(), second.get_state())
    torch.manual_seed(5)
    expected = list(RandomSampler(range(10)))
    torch.manual_seed(5)
    assert epoch_indices(RandomSampler(range(10)))[:].tolist() == expected


def test_seedable_sampler_is_randperm_of_seed_plus_epoch():
    sampler = SeedableRandomSampler(range(12), data_seed=40)
    for epoch in (0, 1, 2):
        sampler.set_epoch(epoch)
        assert (
            list(sampler) == torch.randperm(12, generator=torch.Generator().manual_seed(40 + epoch)).tolist()
        )
    sampler.set_epoch(1)
    assert (
        epoch_indices(sampler)[:].tolist()
        == torch.randperm(12, generator=torch.Generator().manual_seed(41)).tolist()
    )
    assert sampler.epoch == 2


def shard_loader(size: int, world: int, rank: int, **kwargs) -> DataLoader:
    loader = DataLoader(range(size), batch_size=kwargs.pop("batch_size", 2), **kwargs)
    return prepare_data_loader(loader, num_processes=world, process_index=rank)


def test_loader_flags_last_batch_and_registers_with_gradient_state():
    loader = shard_loader(10, 2, 1)
    assert isinstance(loader, DataLoaderShard) and isinstance(loader, DataLoader)
    assert len(loader) == 3 and loader.total_batch_size == 4 and loader.total_dataset_length == 10
    seen, flags, active = [], [], []
    for batch in loader:
        seen.append(batch.tolist())
        flags.append(loader.end_of_dataloader)
        active.append(GradientState().active_dataloader is loader)
    assert seen == [[2, 3], [6, 7], [0, 1]]
    assert flags == [False, False, True]
    assert active == [True, True, True]
    assert GradientState().active_dataloader is None
    assert loader.remainder == 2


def test_world_size_one_is_not_sharded_but_tracked():
    loader = prepare_data_loader(DataLoader(range(5), batch_size=2), num_processes=1, process_index=0)
    flags = []
    assert [b.tolist() for b in loader if flags.append(loader.end_of_dataloader) is None] == [
        [0, 1],
        [2, 3],
        [4],
    ]
    assert flags == [False, False, True]
    assert loader.remainder == 1
    iterable = prepare_data_loader(DataLoader(Stream(5), batch_size=2), num_processes=1, process_index=0)
    assert [b.tolist() for b in iterable] == [[0, 1], [2, 3], [4]]
    assert iterable.remainder == 1


class Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


def test_iterable_shard_loader_reports_remainder():
    loaders = [
        prepare_data_loader(DataLoader(Stream(7), batch_size=2), num_processes=2, process_index=r)
        for r in range(2)
    ]
    assert [[b.tolist() for b in loader] for loader in loaders] == [[[0, 1], [4, 5]], [[2, 3], [6, 0]]]
    assert [loader.remainder for loader in loaders] == [3, 3]
    assert loaders[0].total_batch_size == 4 and len(loaders[0]) == 2


def roundtrip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_state_dict_resumes_shuffled_epoch_mid_way():
    def make() -> DataLoader:
        loader = DataLoader(range(40), batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(9))
        return prepare_data_loader(loader, num_processes=2, process_index=1)

    loader = make()
    epoch0 = [b.tolist() for b in loader]  # advance to epoch 1 so the generator state matters
    iterator = iter(loader)
    head = [next(iterator).tolist() for _ in range(3)]
    state = roundtrip(loader.state_dict())
    tail = [b.tolist() for b in iterator]
    assert state["epoch"] == 1 and state["batches_yielded"] == 3 and state["total_batch_size"] == 6
    assert len(head) + len(tail) == 7 and head + tail != epoch0
    resumed = make()
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == tail
    assert resumed.state_dict()["epoch"] == 2
    assert [b.tolist() for b in resumed] == [b.tolist() for b in loader]  # epoch 2 continues in step


def test_a_random_collate_resumes_with_the_look_ahead_batch_it_drew_before_the_checkpoint():
    """The loader reads one batch ahead, so batch 2's noise is drawn before step 1's: the state holds
    torch's generator from before that read, and the resumed epoch draws batch 2's noise from there."""

    def noisy(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32) + torch.rand(len(values))

    def make() -> DataLoader:
        loader = DataLoader(range(48), batch_size=3, collate_fn=noisy)
        return prepare_data_loader(loader, num_processes=2, process_index=0)

    torch.manual_seed(0)
    loader = make()
    iterator = iter(loader)
    next(iterator), next(iterator)
    torch.rand(4)  # a training step (dropout) after batch 1 was handed out
    state, saved_rng = roundtrip(loader.state_dict()), torch.get_rng_state()  # what save_state writes
    tail, later = list(iterator), torch.rand(4)
    assert state["batches_yielded"] == 2 and state["lookahead_rng"].dtype == torch.uint8

    resumed = make()
    torch.set_rng_state(saved_rng)  # load_state restores the generators, then the loader's position
    resumed.load_state_dict(state)
    replayed = list(resumed)
    assert len(replayed) == len(tail) == 6
    assert all(torch.equal(a, b) for a, b in zip(replayed, tail, strict=True))
    assert torch.equal(torch.rand(4), later)  # and every later draw is the uninterrupted run's


def test_the_look_ahead_generator_is_saved_only_mid_epoch():
    loader = shard_loader(8, 2, 0)
    states = [roundtrip(loader.state_dict()) for _ in loader]
    assert ["lookahead_rng" in state for state in states] == [True, False]  # after the last batch: next epoch
    assert "lookahead_rng" not in roundtrip(loader.state_dict())


def test_state_dict_after_last_batch_points_at_next_epoch():
    loader = shard_loader(8, 2, 0)
    for _ in loader:
        state = loader.state_dict()
    assert (state["epoch"], state["batches_yielded"]) == (1, 0)


def test_resume_at_batch_100000_is_fast():
    base = DataLoader(
        range(1_000_000), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    loader = prepare_data_loader(base, num_processes=2, process_index=1)
    loader.load_state_dict({"epoch": 0, "batches_yielded": 100_000})
    start = time.perf_counter()
    batch = next(iter(loader))
    elapsed = time.perf_counter() - start
    generator = torch.Generator().manual_seed(0)
    torch.empty((), dtype=torch.int64).random_(generator=generator)  # DataLoader's base seed, drawn first
    order = torch.randperm(1_000_000, generator=generator)
    assert batch.tolist() == order[(2 * 100_000 + 1) * 4 : (2 * 100_000 + 2) * 4].tolist()
    assert elapsed < 1.0
    sequential = prepare_data_loader(DataLoader(range(10**9), batch_size=4), num_processes=2, process_index=0)
    sequential.load_state_dict({"epoch": 0, "batches_yielded": 100_000_000})
    start = time.perf_counter()
    assert next(iter(sequential)).tolist() == [800_000_000, 800_000_001, 800_000_002, 800_000_003]
    assert time.perf_counter() - start < 0.5


def test_skip_first_batches():
    assert [b.tolist() for b in skip_first_batches(DataLoader(range(6), batch_size=2), 2)] == [[4, 5]]
    assert len(skip_first_batches(DataLoader(range(6), batch_size=2), 1)) == 2
    assert [b.tolist() for b in skip_first_batches(DataLoader(Stream(6), batch_size=2), 1)] == [
        [2, 3],
        [4, 5],
    ]
    prepared = shard_loader(12, 2, 1)
    skipped = skip_first_batches(prepared, 2)
    assert isinstance(skipped, DataLoaderShard) and len(skipped) == 1
    assert [b.tolist() for b in skipped] == [[10, 11]]
    assert [b.tolist() for b in skipped] == [[10, 11]]  # every epoch, like Accelerate
    with pytest.raises(ValueError, match=r"num_batches=-1\) is invalid"):
        skip_first_batches(prepared, -1)


class NoSizeBatches:
    def __iter__(self):
        return iter([[0, 1], [2, 3]])

    def __len__(self) -> int:
        return 2


def test_bad_input_errors_say_what_and_why():
    with pytest.raises(
        ValueError, match=r"batch size \(5\) to be a round multiple of the number of processes \(2\)"
    ):
        prepare_data_loader(
            DataLoader(range(10), batch_size=5), num_processes=2, process_index=0, split_batches=True
        )
    custom = DataLoader(range(4), batch_sampler=NoSizeBatches())
    with pytest.raises(ValueError, match=r"batch sampler \(NoSizeBatches\) has no `batch_size`"):
        prepare_data_loader(custom, num_processes=2, process_index=0, split_batches=True)
    with pytest.raises(ValueError, match=r"Pass even_batches=False"):
        prepare_data_loader(custom, num_processes=2, process_index=0)
    uneven = prepare_data_loader(custom, num_processes=2, process_index=1, even_batches=False)
    assert [b.tolist() for b in uneven] == [[2, 3]]
    per_sample = DataLoader(range(4), batch_size=None)
    with pytest.raises(ValueError, match=r"batch_size=None and a per-sample sampler"):
        prepare_data_loader(per_sample, num_processes=2, process_index=0)
    with pytest.raises(ValueError, match=r"process_index=2\) is invalid"):
        prepare_data_loader(DataLoader(range(4)), num_processes=2, process_index=2)
    with pytest.raises(TypeError, match=r"got list"):
        prepare_data_loader([1, 2], num_processes=1, process_index=0)
    with pytest.raises(ValueError, match=r"without \['batches_yielded'\]"):
        shard_loader(4, 2, 0).load_state_dict({"epoch": 1})


def test_prepare_does_not_modify_the_original_loader():
    original = DataLoader(range(10), batch_size=2, shuffle=True)
    prepared = prepare_data_loader(
        original, num_processes=2, process_index=0, use_seedable_sampler=True, data_seed=4
    )
    assert original.sampler.generator is None and type(original.sampler) is RandomSampler
    assert isinstance(prepared.batch_sampler.sampler, SeedableRandomSampler)
    assert prepared.batch_sampler.sampler.initial_seed == 4


def test_device_placement_workers_and_batch_sampler_as_sampler():
    on_meta = prepare_data_loader(
        DataLoader(range(5), batch_size=2),
        device="meta",
        put_on_device=True,
        num_processes=2,
        process_index=0,
    )
    assert [(b.device.type, tuple(b.shape)) for b in on_meta] == [("meta", (2,)), ("meta", (2,))]
    workers = prepare_data_loader(
        DataLoader(range(10), batch_size=2, num_workers=1), num_processes=2, process_index=1
    )
    assert [b.tolist() for b in workers] == [[2, 3], [6, 7], [0, 1]] and workers.remainder == 2
    as_sampler = DataLoader(
        Indexable(), sampler=BatchSampler(SequentialSampler(range(10)), 3, False), batch_size=None
    )
    shard = prepare_data_loader(as_sampler, num_processes=2, process_index=1)
    assert [b.tolist() for b in shard] == [[3, 4, 5], [9, 0, 1]]
    assert (len(shard), shard.total_batch_size, shard.remainder) == (2, 6, 4)


class Indexable:
    def __len__(self) -> int:
        return 10

    def __getitem__(self, index):
        return torch.tensor(index)


def test_dispatcher_at_world_size_one_does_not_pad():
    loader = prepare_data_loader(
        DataLoader(range(5), batch_size=2), put_on_device=True, dispatch_batches=True
    )
    assert type(loader).__name__ == "DataLoaderDispatcher"
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4]]
    assert (loader.remainder, len(loader), loader.end_of_dataloader) == (1, 3, True)


def test_loading_a_state_saved_with_another_global_batch_size_converts_and_warns():
    loader = shard_loader(20, 1, 0)
    with pytest.warns(
        UserWarning, match=r"saved with 4 samples per step and this loader takes 2: resuming at batch 6"
    ):
        loader.load_state_dict({"epoch": 0, "batches_yielded": 3, "total_batch_size": 4})
    assert [b.tolist() for b in loader] == [[12, 13], [14, 15], [16, 17], [18, 19]]
