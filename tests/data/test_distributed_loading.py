"""Prepared dataloaders in real gloo process groups (2 and 3 processes)."""

from __future__ import annotations

import io

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from lockstep.data import DataLoaderDispatcher, DataLoaderShard, prepare_data_loader
from lockstep.state import PartialState
from tests.helpers.multiprocess import run_distributed

pytestmark = pytest.mark.distributed


def _roundtrip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _epoch(loader) -> tuple[list, list[bool]]:
    batches, flags = [], []
    for batch in loader:
        batches.append(batch.tolist() if isinstance(batch, torch.Tensor) else batch)
        flags.append(loader.end_of_dataloader)
    return batches, flags


def _rounds_flat(per_rank: list[list[list[int]]]) -> list[list[int]]:
    longest = max(len(b) for b in per_rank)
    return [[i for b in per_rank if k < len(b) for i in b[k]] for k in range(longest)]


def _real_samples(per_rank: list[list[list[int]]], remainder: int) -> list[int]:
    rounds = _rounds_flat(per_rank)
    return [i for r in rounds[:-1] for i in r] + rounds[-1][:remainder]


# -- shuffling without a seed: rank 0's generator drives every rank ---------------------------------
def _unseeded_shuffle_worker() -> dict:
    state = PartialState()
    torch.manual_seed(1000 + state.process_index)  # without synchronisation the ranks would disagree

    def make() -> DataLoader:
        return prepare_data_loader(DataLoader(range(23), batch_size=2, shuffle=True))

    loader = make()
    assert isinstance(loader, DataLoaderShard)
    epochs = [_epoch(loader) for _ in range(2)]
    iterator = iter(loader)
    head = [next(iterator).tolist() for _ in range(2)]
    saved = _roundtrip(loader.state_dict())
    tail = [b.tolist() for b in iterator]
    torch.manual_seed(77)
    resumed = make()
    resumed.load_state_dict(saved)
    return {
        "epochs": epochs,
        "remainder": loader.remainder,
        "head": head,
        "tail": tail,
        "resumed": _epoch(resumed),
        "saved": (saved["epoch"], saved["batches_yielded"]),
    }


@pytest.mark.parametrize("world", [2, 3])
def test_unseeded_shuffle_is_one_permutation_and_resumes(world):
    results = run_distributed(_unseeded_shuffle_worker, world)
    per_process = 2 * world
    padded = -(-23 // per_process) * per_process
    assert {r["remainder"] for r in results} == {23 % per_process}
    orders = []
    for epoch in range(2):
        per_rank = [r["epochs"][epoch][0] for r in results]
        assert {len(b) for b in per_rank} == {padded // per_process}
        for r in results:
            flags = r["epochs"][epoch][1]
            assert flags == [False] * (len(flags) - 1) + [True]
        everything = [i for round_ in _rounds_flat(per_rank) for i in round_]
        order = everything[:23]
        assert sorted(order) == list(range(23))  # disjoint shards covering the dataset
        assert everything[23:] == order[: padded - 23]  # padding cycles from the epoch's start
        orders.append(order)
    assert orders[0] != orders[1] and orders[0] != list(range(23))
    for r in results:
        assert r["saved"] == (2, 2)
        assert r["resumed"][0] == r["tail"] and r["resumed"][1][-1] is True
        assert len(r["head"]) + len(r["tail"]) == padded // per_process


# -- seedable sampler: order = randperm(seed + epoch) everywhere --------------------------------------
def _seedable_worker() -> list[list[list[int]]]:
    state = PartialState()
    torch.manual_seed(1000 + state.process_index)  # data_seed=None takes rank 0's initial seed
    loader = prepare_data_loader(DataLoader(range(20), batch_size=2, shuffle=True), use_seedable_sampler=True)
    epochs = []
    for epoch in (0, 1, 0):
        loader.set_epoch(epoch)
        epochs.append([b.tolist() for b in loader])
    return epochs


def test_seedable_sampler_is_reproducible_and_changes_per_epoch():
    results = run_distributed(_seedable_worker, 3)
    for index, epoch in enumerate((0, 1, 0)):
        per_rank = [r[index] for r in results]
        expected = torch.randperm(20, generator=torch.Generator().manual_seed(1000 + epoch)).tolist()
        assert _real_samples(per_rank, 20 % 6) == expected
    assert [r[0] for r in results] == [r[2] for r in results]
    assert [r[0] for r in results] != [r[1] for r in results]


# -- dispatching: rank 0 reads, everyone gets a slice ---------------------------------------------------
class Records(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield {"x": torch.tensor([float(i), -float(i)]), "label": f"s{i}"}

    def __len__(self) -> int:
        return self.n


def _dispatch_run(loader) -> dict:
    batches, flags = [], []
    for batch in loader:
        assert batch["x"].shape[0] == len(batch["label"])
        batches.append([(int(x), label) for x, label in zip(batch["x"][:, 0], batch["label"])])
        flags.append(loader.end_of_dataloader)
    return {"batches": batches, "flags": flags, "remainder": loader.remainder, "len": len(loader)}


def _dispatch_worker() -> dict:
    state = PartialState()
    out = {}
    for split in (False, True):
        loader = prepare_data_loader(
            DataLoader(Records(11), batch_size=3 * state.num_processes if split else 2),
            put_on_device=True,
            split_batches=split,
        )
        assert isinstance(loader, DataLoaderDispatcher)
        out[split] = _dispatch_run(loader)
    stream = prepare_data_loader(DataLoader(Records(11), batch_size=2), put_on_device=True)
    iterator = iter(stream)
    next(iterator)
    saved = _roundtrip(stream.state_dict())
    iterator.close()
    resumed_stream = prepare_data_loader(DataLoader(Records(11), batch_size=2), put_on_device=True)
    resumed_stream.load_state_dict(saved)
    out["stream_resumed"] = _dispatch_run(resumed_stream)
    mapped = prepare_data_loader(
        DataLoader(range(9), batch_size=2), put_on_device=True, dispatch_batches=True
    )
    full = [b.tolist() for b in mapped]
    iterator = iter(mapped)
    next(iterator)
    saved = _roundtrip(mapped.state_dict())
    iterator.close()
    resumed = prepare_data_loader(
        DataLoader(range(9), batch_size=2), put_on_device=True, dispatch_batches=True
    )
    resumed.load_state_dict(saved)
    out["map"] = {"full": full, "resumed": [b.tolist() for b in resumed], "rank": state.process_index}
    return out


def _check_dispatch(per_rank: list[dict], global_size: int) -> None:
    batches = [r["batches"] for r in per_rank]
    assert {r["remainder"] for r in per_rank} == {11 % global_size}
    assert _real_samples(batches, 11 % global_size) == [(i, f"s{i}") for i in range(11)]
    padding = [s for round_ in _rounds_flat(batches)[-1:] for s in round_][11 % global_size :]
    assert padding == [(i, f"s{i}") for i in range(len(padding))]
    for r in per_rank:
        assert r["flags"] == [False] * (len(r["flags"]) - 1) + [True]
        assert len(r["batches"]) == r["len"] == -(-11 // global_size)


@pytest.mark.parametrize("world", [2, 3])
def test_dispatch_batches_gives_each_rank_its_slice(world):
    results = run_distributed(_dispatch_worker, world)
    _check_dispatch([r[False] for r in results], 2 * world)
    _check_dispatch([r[True] for r in results], 3 * world)
    for r in results:
        assert r["map"]["resumed"] == r["map"]["full"][1:]
        assert r["stream_resumed"]["batches"] == r[False]["batches"][1:]
        assert r["stream_resumed"]["flags"][-1] is True
    expected_last = {2: [[8, 0], [1, 2]], 3: [[6, 7], [8, 0], [1, 2]]}[world]
    assert [r["map"]["full"][-1] for r in results] == expected_last


def _split_not_divisible_worker() -> str:
    PartialState()
    try:
        prepare_data_loader(DataLoader(Records(4), batch_size=4), put_on_device=True, split_batches=True)
    except ValueError as error:
        return str(error)
    return "no error"


def test_dispatch_split_needs_divisible_batch_size():
    messages = run_distributed(_split_not_divisible_worker, 3)
    assert all("batch size (4) to be a round multiple of the number of processes (3)" in m for m in messages)
