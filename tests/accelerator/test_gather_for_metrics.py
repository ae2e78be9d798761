"""gather_for_metrics returns exactly the dataset, in order: lengths 1..40, world sizes 1, 2, 3."""

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lockstep import Accelerator, DataLoaderConfiguration
from tests.helpers.multiprocess import run_distributed

LENGTHS = range(1, 41)


class _Stream(IterableDataset):
    def __init__(self, length: int) -> None:
        self.length = length

    def __iter__(self):
        yield from (torch.tensor([i]) for i in range(self.length))


def _expected(length: int, batch: int, world: int, drop_last: bool) -> list[int]:
    if not drop_last:
        return list(range(length))
    return list(range((length // (batch * world)) * batch * world))


def _collect(accelerator: Accelerator, dl: DataLoader) -> list[int]:
    gathered = []
    for batch in accelerator.prepare(dl):
        values = batch[0] if isinstance(batch, (list, tuple)) else batch
        gathered.extend(accelerator.gather_for_metrics(values.reshape(-1)).tolist())
    return gathered


def _check_all_lengths(split: bool) -> list[str]:
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=split))
    world = accelerator.num_processes
    failures = []
    for length in LENGTHS:
        dataset = TensorDataset(torch.arange(length))
        cases = {
            "map": (DataLoader(dataset, batch_size=3 * world if split else 3), False),
            "map drop_last": (
                DataLoader(dataset, batch_size=2 * world if split else 2, drop_last=True),
                True,
            ),
            "iterable": (DataLoader(_Stream(length), batch_size=2 * world if split else 2), False),
        }
        for name, (dl, drop_last) in cases.items():
            per_process = dl.batch_size // world if split else dl.batch_size
            expected = _expected(length, per_process, world, drop_last)
            got = _collect(accelerator, dl)
            if got != expected:
                failures.append(f"{name} length {length}: got {got}, expected {expected}")
    return failures


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("split", [False, True], ids=["whole-batches", "split-batches"])
def test_gather_for_metrics_is_exact(world_size, split):
    results = run_distributed(_check_all_lengths, world_size, split, timeout=180)
    assert results[0] == [], "\n".join(results[0][:10])
    assert all(r == results[0] for r in results)


def test_gather_for_metrics_single_process():
    assert _check_all_lengths(False) == []


def _gather_objects() -> list:
    accelerator = Accelerator()
    dl = accelerator.prepare(DataLoader(list(range(5)), batch_size=2))
    out = []
    for batch in dl:
        out.extend(accelerator.gather_for_metrics([f"s{int(i)}" for i in batch]))
    return out


@pytest.mark.distributed
def test_gather_for_metrics_of_python_objects():
    rank0, rank1 = run_distributed(_gather_objects, 2)
    assert rank0 == rank1 == ["s0", "s1", "s2", "s3", "s4"]
