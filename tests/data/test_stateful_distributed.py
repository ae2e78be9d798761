"""use_stateful_dataloader=True in real gloo groups: mid-epoch states resume in a fresh process group, from
the loader itself and through Accelerator.save_state / load_state."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from lockstep import Accelerator
from lockstep.config import DataLoaderConfiguration
from lockstep.data import DataLoaderDispatcher, DataLoaderShard, prepare_data_loader
from lockstep.state import PartialState
from tests.checkpoint import test_exact_resume
from tests.data._stateful_data import CountingStream, ServedCounter, as_lists, values
from tests.helpers.multiprocess import run_distributed
from tests.helpers.optional import requires

pytestmark = [pytest.mark.distributed, requires("torchdata")]

SAVE_AFTER = 2


def _prepare(kind: str, stateful: bool = True) -> DataLoader:
    rank = PartialState().process_index
    torch.manual_seed(100 + rank)  # unseeded shuffling: rank 0's generator must drive every rank
    if kind == "map":
        original = DataLoader(ServedCounter(23), batch_size=2, shuffle=True)
        return prepare_data_loader(original, use_stateful_dataloader=stateful)
    original = DataLoader(CountingStream(11), batch_size=2)
    # "stream": each rank reads the whole stream through an IterableDatasetShard; "dispatch": rank 0 reads.
    return prepare_data_loader(original, put_on_device=kind == "dispatch", use_stateful_dataloader=stateful)


def _epoch(loader: DataLoader) -> tuple[list, list, int]:
    batches, flags = [], []
    for batch in loader:
        batches.append(batch.tolist())
        flags.append(loader.end_of_dataloader)
    return batches, flags, loader.remainder


def _run_and_save(kind: str, path: str) -> dict:
    from torchdata.stateful_dataloader import StatefulDataLoader

    plain = _epoch(_prepare(kind, stateful=False))
    assert _epoch(_prepare(kind)) == plain  # the same batches, flags and remainder as without torchdata
    straight = plain[0]
    loader = _prepare(kind)
    assert isinstance(loader, StatefulDataLoader)
    assert isinstance(loader, DataLoaderDispatcher if kind == "dispatch" else DataLoaderShard)
    iterator = iter(loader)
    head = [next(iterator).tolist() for _ in range(SAVE_AFTER)]
    state = loader.state_dict()
    if PartialState().is_main_process:  # as save_state does: the main process's state, for every rank
        torch.save(state, path)
    iterator.close()
    return {"straight": straight, "head": head, "keys": sorted(state)}


def _load_and_finish(kind: str, path: str) -> list:
    loader = _prepare(kind)
    loader.load_state_dict(torch.load(path, weights_only=True))
    return as_lists(loader)


KINDS = ("map", "stream", "dispatch")


def _each_kind(fn: Callable[[str, str], Any], folder: str) -> dict[str, Any]:
    """``fn(kind, path)`` for every kind in turn, in this one process group; a failure names its kind."""
    results = {}
    for kind in KINDS:
        try:
            results[kind] = fn(kind, f"{folder}/{kind}.pt")
        except Exception as error:
            raise AssertionError(f"the {kind!r} loader failed") from error
    return results


@pytest.fixture(scope="module")
def mid_epoch(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], list[dict]]:
    """Each kind's states saved in one process group, then loaded and finished in another, fresh one."""
    folder = str(tmp_path_factory.mktemp("loaders"))
    before = run_distributed(_each_kind, 2, _run_and_save, folder)
    return before, run_distributed(_each_kind, 2, _load_and_finish, folder)


@pytest.mark.parametrize("kind", KINDS)
def test_a_mid_epoch_state_resumes_in_a_fresh_process_group(mid_epoch, kind):
    before = [result[kind] for result in mid_epoch[0]]
    after = [result[kind] for result in mid_epoch[1]]
    for rank in range(2):
        straight, head, tail = before[rank]["straight"], before[rank]["head"], after[rank]
        assert head == straight[:SAVE_AFTER]
        assert values(tail) == values(straight[SAVE_AFTER:]), f"rank {rank}"
    assert "stateful_dataloader" in before[0]["keys"]
    if kind == "map":  # 23 samples: 6 batches of 2 per rank, the last padded from the epoch's start
        per_rank = [before[r]["straight"] for r in range(2)]
        assert [len(b) for b in per_rank] == [6, 6]
        everything = [i for k in range(6) for r in range(2) for i, _ in per_rank[r][k]]
        assert sorted(everything[:23]) == list(range(23)) and everything[23] == everything[0]
        for rank in range(2):  # the dataset's served counter is restored, not restarted
            assert after[rank] == before[rank]["straight"][SAVE_AFTER:]
    else:  # the stream restored its own position: the items after the save were produced afresh
        assert all(after[r] != before[r]["straight"][SAVE_AFTER:] for r in range(2))
    if kind == "dispatch":  # the first global batch pads the last one: [8, 9, 10] + [0]
        assert "first_batch" in before[0]["keys"]
        assert values(after[0])[-1] + values(after[1])[-1] == [8, 9, 10, 0]


# -- through the Accelerator ----------------------------------------------------------------------------
def _accelerated(folder: str, resume: bool) -> dict:
    from torchdata.stateful_dataloader import StatefulDataLoader

    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    torch.manual_seed(7)
    shuffled = DataLoader(ServedCounter(20), batch_size=2, shuffle=True)
    stream = DataLoader(CountingStream(13), batch_size=2)
    shuffled, stream = accelerator.prepare(shuffled, stream)
    assert isinstance(shuffled, StatefulDataLoader) and isinstance(stream, StatefulDataLoader)
    assert isinstance(stream, DataLoaderDispatcher)  # the Accelerator dispatches iterable data
    if resume:
        accelerator.load_state(folder)
        return {"shuffled": as_lists(shuffled), "stream": as_lists(stream)}
    out = {"shuffled": [], "stream": []}
    for name, loader in (("shuffled", shuffled), ("stream", stream)):
        iterator = iter(loader)
        out[name] = [next(iterator).tolist() for _ in range(3)]
        out[name + "_iterator"] = iterator
    accelerator.save_state(folder)
    for name in ("shuffled", "stream"):
        out[name] += as_lists(out.pop(name + "_iterator"))
    return out


def test_save_state_and_load_state_carry_the_stateful_loaders(tmp_path):
    folder = str(tmp_path / "checkpoint")
    before = run_distributed(_accelerated, 2, folder, False)
    after = run_distributed(_accelerated, 2, folder, True)
    files = {path.name: torch.load(path, weights_only=True) for path in Path(folder).glob("dataloader*.bin")}
    assert sorted(files) == ["dataloader.bin", "dataloader_1.bin"]  # Accelerate's naming
    for state in files.values():
        assert (state["epoch"], state["batches_yielded"]) == (0, 3) and "stateful_dataloader" in state
    assert "first_batch" in files["dataloader_1.bin"]  # the dispatcher over the stream
    for rank in range(2):
        assert after[rank]["shuffled"] == before[rank]["shuffled"][3:], f"rank {rank}"
        assert values(after[rank]["stream"]) == values(before[rank]["stream"][3:]), f"rank {rank}"
    # 13 items in global batches of 4: rank 0 reads 3 steps before the save and 1 after, from its own state.
    assert values(after[0]["stream"]) + values(after[1]["stream"]) == [[12, 0], [1, 2]]
    assert after[0]["stream"][0][0][1] == 1  # item 12 is the first item the restored stream produced


# -- the exact-resume training run, with stateful loaders ---------------------------------------------
def _stateful_training(folder: str, save_at: int | None, resume: bool) -> tuple:
    config = DataLoaderConfiguration(use_stateful_dataloader=True)
    # Only in this forked worker: the canonical exact-resume loop, its Accelerator given stateful loaders.
    test_exact_resume.Accelerator = functools.partial(Accelerator, dataloader_config=config)
    return test_exact_resume._train(folder, save_at, resume)


def test_training_resumed_with_stateful_loaders_is_bitwise_exact(tmp_path):
    folder = str(tmp_path / "checkpoint")
    straight = run_distributed(_stateful_training, 2, folder, None, False)
    before = run_distributed(_stateful_training, 2, folder, 7, False)  # mid-epoch, mid-accumulation
    after = run_distributed(_stateful_training, 2, folder, None, True)
    assert "stateful_dataloader" in torch.load(Path(folder) / "dataloader.bin", weights_only=True)
    for rank in range(2):
        losses, params = straight[rank]
        assert before[rank][0] == losses[:7]
        assert after[rank][0] == losses[7:], f"rank {rank}: losses after resume differ"
        assert torch.equal(after[rank][1], params), f"rank {rank}: final parameters differ"
