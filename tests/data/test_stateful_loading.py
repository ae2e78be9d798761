"""use_stateful_dataloader=True: prepared loaders that are torchdata StatefulDataLoaders (one process)."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.utils.data import DataLoader

from lockstep.config import DataLoaderConfiguration
from lockstep.data import DataLoaderDispatcher, DataLoaderShard, prepare_data_loader, skip_first_batches
from tests.data._stateful_data import (
    CountingStream,
    PlainStream,
    ServedCounter,
    as_lists,
    roundtrip,
    values,
)
from tests.helpers.optional import requires

PIP_LINE = r"pip install 'lockstep\[stateful\]' \(or pip install torchdata\)"


# -- the setting ----------------------------------------------------------------------------------------
def test_the_setting_is_checked_as_a_bool():
    with pytest.raises(
        TypeError, match=r"DataLoaderConfiguration\(use_stateful_dataloader='yes'\) is invalid"
    ):
        DataLoaderConfiguration(use_stateful_dataloader="yes")
    assert DataLoaderConfiguration().use_stateful_dataloader is False


def test_without_torchdata_each_entry_point_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchdata", None)
    monkeypatch.setitem(sys.modules, "torchdata.stateful_dataloader", None)
    with pytest.raises(
        ImportError, match=r"DataLoaderConfiguration\(use_stateful_dataloader=True\) needs .*" + PIP_LINE
    ):
        DataLoaderConfiguration(use_stateful_dataloader=True)
    with pytest.raises(
        ImportError, match=r"prepare_data_loader\(use_stateful_dataloader=True\) needs .*" + PIP_LINE
    ):
        prepare_data_loader(
            DataLoader(range(4)), num_processes=1, process_index=0, use_stateful_dataloader=True
        )
    with pytest.raises(
        ImportError, match=r"DataLoaderShard\(use_stateful_dataloader=True\) needs .*" + PIP_LINE
    ):
        DataLoaderShard(range(4), batch_size=2, use_stateful_dataloader=True)
    # Off (the default), nothing imports torchdata.
    assert DataLoaderConfiguration(use_stateful_dataloader=False).use_stateful_dataloader is False
    plain = prepare_data_loader(DataLoader(range(4), batch_size=2), num_processes=1, process_index=0)
    assert as_lists(plain) == [[0, 1], [2, 3]] and plain.use_stateful_dataloader is False


@requires("torchdata")
def test_an_older_torchdata_is_refused_with_the_upgrade_line(monkeypatch):
    monkeypatch.setattr("lockstep.config.dataloader._torchdata_version", lambda: "0.8.0")
    with pytest.raises(
        ImportError, match=r"needs torchdata>=0.11 .*0\.8\.0 is installed: pip install -U 'torchdata>=0.11'"
    ):
        DataLoaderConfiguration(use_stateful_dataloader=True)


# -- same loaders, stateful ----------------------------------------------------------------------------
CASES = {
    "map, 1 process": (lambda: DataLoader(range(9), batch_size=2, shuffle=True), 1, 0, {}),
    "map, rank 1 of 2, even": (lambda: DataLoader(range(11), batch_size=2, shuffle=True), 2, 1, {}),
    "map, rank 1 of 2, split, uneven": (
        lambda: DataLoader(range(11), batch_size=4, shuffle=True),
        2,
        1,
        {"split_batches": True, "even_batches": False},
    ),
    "map, rank 0 of 2, seedable sampler": (
        lambda: DataLoader(range(10), batch_size=3, shuffle=True),
        2,
        0,
        {"use_seedable_sampler": True, "data_seed": 3},
    ),
    "map, 1 process, on the device": (
        lambda: DataLoader(range(5), batch_size=2),
        1,
        0,
        {"put_on_device": True, "device": "cpu"},
    ),
    "stream, 1 process": (lambda: DataLoader(CountingStream(7), batch_size=2), 1, 0, {}),
    "stream, rank 1 of 2": (lambda: DataLoader(CountingStream(11), batch_size=2), 2, 1, {}),
}


def _two_epochs(make, world: int, rank: int, options: dict, stateful: bool) -> tuple:
    torch.manual_seed(0)
    loader = prepare_data_loader(
        make(), num_processes=world, process_index=rank, use_stateful_dataloader=stateful, **options
    )
    epochs = []
    for epoch in (2, 0):
        loader.set_epoch(epoch)
        batches, flags = [], []
        for batch in loader:
            batches.append(batch.tolist())
            flags.append(loader.end_of_dataloader)
        epochs.append((batches, flags, loader.remainder))
    return loader, epochs, len(loader), loader.total_batch_size


@requires("torchdata")
@pytest.mark.parametrize("case", list(CASES))
def test_every_prepared_loader_is_a_stateful_dataloader_with_the_same_batches(case):
    from torchdata.stateful_dataloader import StatefulDataLoader

    make, world, rank, options = CASES[case]
    stateful, *facts = _two_epochs(make, world, rank, options, stateful=True)
    plain, *plain_facts = _two_epochs(make, world, rank, options, stateful=False)
    assert isinstance(stateful, StatefulDataLoader) and isinstance(stateful, DataLoaderShard)
    assert stateful.use_stateful_dataloader is True
    assert not isinstance(plain, StatefulDataLoader)
    assert facts == plain_facts
    (first, flags, _), _ = facts[0]
    assert flags == [False] * (len(first) - 1) + [True]


@requires("torchdata")
def test_accelerate_style_constructors_make_stateful_loaders():
    from torchdata.stateful_dataloader import StatefulDataLoader

    shard = DataLoaderShard(list(range(16)), batch_size=4, use_stateful_dataloader=True)
    dispatcher = DataLoaderDispatcher(range(16), batch_size=4, use_stateful_dataloader=True)
    assert type(shard).__name__ == "StatefulDataLoaderShard"
    assert type(dispatcher).__name__ == "StatefulDataLoaderDispatcher"
    for loader in (shard, dispatcher):
        assert isinstance(loader, StatefulDataLoader) and loader.use_stateful_dataloader
        for _ in range(2):
            flags = [loader.end_of_dataloader for _ in loader]
            assert flags == [False, False, False, True]
    assert as_lists(dispatcher) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]


# -- mid-epoch round trips ------------------------------------------------------------------------------
def _map_loader(workers: int, seed: int) -> DataLoader:
    torch.manual_seed(seed)
    original = DataLoader(ServedCounter(14), batch_size=2, shuffle=True, num_workers=workers)
    return prepare_data_loader(original, num_processes=1, process_index=0, use_stateful_dataloader=True)


@requires("torchdata")
@pytest.mark.parametrize("workers", [0, 2])
def test_map_style_state_round_trips_mid_epoch_with_the_datasets_state(workers):
    straight = _map_loader(workers, seed=0)
    epoch0 = as_lists(straight)
    after_epoch0 = torch.get_rng_state()  # one process: the next epoch draws from the global generator
    epoch1 = as_lists(straight)
    loader = _map_loader(workers, seed=0)
    iterator = iter(loader)
    head = [next(iterator).tolist() for _ in range(3)]
    saved = roundtrip(loader.state_dict())
    iterator.close()
    assert head == epoch0[:3]
    assert (saved["epoch"], saved["batches_yielded"]) == (0, 3)
    torchdata_part = saved["stateful_dataloader"]
    if workers == 0:
        assert torchdata_part["_sampler_iter_yielded"] == 3 and torchdata_part["dataset_state"] == {
            "served": 6
        }
    else:  # worker 0 served batches 0 and 2, worker 1 batch 1
        workers_state = torchdata_part["_snapshot"]["_worker_snapshots"]
        assert [workers_state[f"worker_{w}"]["dataset_state"] for w in range(2)] == [
            {"served": 4},
            {"served": 2},
        ]
    resumed = _map_loader(workers, seed=123)  # another global seed: the order comes from the state
    resumed.load_state_dict(saved)
    assert as_lists(resumed) == epoch0[3:]  # values and each copy's served counter continue
    torch.set_rng_state(after_epoch0)  # as load_state restores it with the rest of a checkpoint
    assert as_lists(resumed) == epoch1
    assert sorted(i for batch in epoch0 for i, _ in batch) == list(range(14))


def _stream_loader(dataset, workers: int, world: int, rank: int) -> DataLoader:
    original = DataLoader(dataset, batch_size=2, num_workers=workers)
    return prepare_data_loader(
        original, num_processes=world, process_index=rank, use_stateful_dataloader=True
    )


@requires("torchdata")
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize(("world", "rank"), [(1, 0), (2, 0), (2, 1)])
def test_a_stateful_stream_resumes_from_its_own_state(workers, world, rank):
    straight = as_lists(_stream_loader(CountingStream(11), workers, world, rank))
    loader = _stream_loader(CountingStream(11), workers, world, rank)
    iterator = iter(loader)
    head = [next(iterator).tolist() for _ in range(2)]
    saved = roundtrip(loader.state_dict())
    iterator.close()
    dataset = CountingStream(11)
    resumed = _stream_loader(dataset, workers, world, rank)
    resumed.load_state_dict(saved)
    tail = as_lists(resumed)
    assert head == straight[:2]
    assert values(tail) == values(straight[2:])
    # Restored, not read again: the counters of the copies that produced the tail started over after the save
    # (with 2 workers, rank 1's tail is all padding from the first round, the same either way).
    assert tail != straight[2:] or (workers, world, rank) == (2, 2, 1)
    expected = {
        (0, 1, 0): [[[4, 1], [5, 2]], [[6, 3], [7, 4]], [[8, 5], [9, 6]], [[10, 7]]],
        (0, 2, 0): [[[8, 1], [9, 2]]],
        (0, 2, 1): [
            [[10, 3], [0, 1]]
        ],  # 10 is the 3rd item read after the save; [0, 1] pads, from the first round
        (2, 1, 0): [[[4, 1], [6, 2]], [[5, 1], [7, 2]], [[8, 3], [10, 4]], [[9, 3]]],
    }
    if (workers, world, rank) in expected:
        assert tail == expected[workers, world, rank]
    if workers == 0:
        assert dataset.loaded == [{"position": 4 * world}]
    if workers == 0 and world == 2:  # the shard passed the stream's state on, with the first round
        first_round = saved["stateful_dataloader"]["dataset_state"]["first_round"]
        assert [item.tolist() for item in first_round] == [[0, 1], [1, 2], [2, 3], [3, 4]]


@requires("torchdata")
@pytest.mark.parametrize("world", [1, 2])
def test_a_stream_without_state_is_read_again_up_to_the_saved_batch(world):
    straight = as_lists(_stream_loader(PlainStream(11), 0, world, 0))
    loader = _stream_loader(PlainStream(11), 0, world, 0)
    iterator = iter(loader)
    next(iterator)
    saved = roundtrip(loader.state_dict())
    iterator.close()
    resumed = _stream_loader(PlainStream(11), 0, world, 0)
    resumed.load_state_dict(saved)
    tail = as_lists(resumed)
    assert tail == straight[1:]  # read again from the start: the counters match the straight run's


# -- the state at the edges ------------------------------------------------------------------------------
@requires("torchdata")
def test_at_epoch_boundaries_the_state_is_lockstep_position_only():
    loader = _map_loader(2, seed=0)
    fresh = loader.state_dict()
    assert "stateful_dataloader" not in fresh and loader._iterator is None  # no workers started for it
    as_lists(loader)
    after = loader.state_dict()
    assert (after["epoch"], after["batches_yielded"]) == (1, 0) and "stateful_dataloader" not in after


@requires("torchdata")
def test_the_state_after_loading_is_the_loaded_state_until_the_loader_is_read():
    loader = _map_loader(0, seed=0)
    iterator = iter(loader)
    next(iterator)
    saved = roundtrip(loader.state_dict())
    iterator.close()
    resumed = _map_loader(0, seed=7)
    resumed.load_state_dict(saved)
    again = resumed.state_dict()
    assert sorted(again) == sorted(saved)
    assert again["base_seed"] == saved["base_seed"] and again["batches_yielded"] == 1
    assert again["stateful_dataloader"] == saved["stateful_dataloader"]
    assert again["epoch_seed"] == saved["epoch_seed"]  # the seed the interrupted epoch drew


@requires("torchdata")
def test_a_state_saved_with_other_workers_warns_and_resumes_at_the_position():
    straight = as_lists(_map_loader(2, seed=0))
    loader = _map_loader(2, seed=0)
    iterator = iter(loader)
    next(iterator)
    saved = roundtrip(loader.state_dict())
    iterator.close()
    resumed = _map_loader(0, seed=5)
    with pytest.warns(UserWarning, match=r"saved with num_workers=2 and this loader has num_workers=0"):
        resumed.load_state_dict(saved)
    tail = as_lists(resumed)
    assert values(tail) == values(straight[1:])
    assert [row[1] for row in tail[0]] == [1, 2]  # the dataset's state was left out: its counter restarts


@requires("torchdata")
def test_skip_first_batches_keeps_the_loader_stateful():
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = prepare_data_loader(
        DataLoader(range(10), batch_size=2), num_processes=1, process_index=0, use_stateful_dataloader=True
    )
    skipping = skip_first_batches(loader, 2)
    assert isinstance(skipping, StatefulDataLoader) and type(skipping) is type(loader)
    iterator = iter(skipping)
    assert next(iterator).tolist() == [4, 5]
    saved = roundtrip(skipping.state_dict())
    iterator.close()
    assert saved["batches_yielded"] == 3
    loader.load_state_dict(saved)
    assert as_lists(loader) == [[6, 7], [8, 9]]


# -- Accelerator.dataloader_config assigned after construction (Accelerate's tests do this) -------------
def _assigned(folder: str, resume: bool) -> list[list[int]]:
    from torchdata.stateful_dataloader import StatefulDataLoader

    from lockstep import Accelerator

    accelerator = Accelerator(cpu=True)
    accelerator.dataloader_config = DataLoaderConfiguration(use_stateful_dataloader=True)
    torch.manual_seed(3)
    loader = accelerator.prepare(DataLoader(ServedCounter(12), batch_size=2, shuffle=True))
    assert isinstance(loader, StatefulDataLoader) and accelerator.use_stateful_dataloader
    if resume:
        accelerator.load_state(folder)
        return as_lists(loader)
    iterator = iter(loader)
    batches = [next(iterator).tolist() for _ in range(2)]
    accelerator.save_state(folder)  # mid-epoch
    return batches + as_lists(iterator)  # the uninterrupted run reads the rest of the epoch


@requires("torchdata")
def test_dataloader_config_assigned_before_prepare_makes_stateful_loaders_that_resume(tmp_path):
    from tests.helpers.multiprocess import reset_lockstep_state

    folder = str(tmp_path / "checkpoint")
    before = _assigned(folder, resume=False)
    state = torch.load(tmp_path / "checkpoint" / "dataloader.bin", weights_only=True)
    assert (state["epoch"], state["batches_yielded"]) == (0, 2) and "stateful_dataloader" in state
    reset_lockstep_state()
    after = _assigned(folder, resume=True)
    # the rest of epoch 0 as the run that was not stopped read it: the same samples in the same order, and
    # the dataset's own counter (restored by the StatefulDataLoader) continuing from the saved state
    assert after == before[2:] and len(after) == 4


def test_dataloader_config_refuses_other_objects():
    from lockstep import Accelerator

    with pytest.raises(
        TypeError, match=r"accelerator.dataloader_config = \{'even_batches': False\} is invalid"
    ):
        Accelerator(cpu=True).dataloader_config = {"even_batches": False}
