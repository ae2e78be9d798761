"""Datasets with a state of their own, for the use_stateful_dataloader tests.

Each item carries a counter of the items its dataset object produced since it was built: a resume that
restores the dataset's state starts that counter again at 1, a resume that reads the data again to the
saved batch does not.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info


class CountingStream(IterableDataset):
    """Yields ``[value, produced]`` for value in ``range(n)`` (split across workers), and saves its position."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.position = 0  # items of this worker's share already produced this epoch
        self.produced = 0
        self.loaded: list[dict] = []

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        mine = list(range(worker, self.n, workers))
        while self.position < len(mine):
            value = mine[self.position]
            self.position += 1
            self.produced += 1
            yield torch.tensor([value, self.produced])
        self.position = 0  # the next epoch starts over

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.loaded.append(dict(state))
        self.position = state["position"]


class PlainStream(IterableDataset):
    """``[value, produced]`` for value in ``range(n)``, with no state: a resume must read it again."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.produced = 0

    def __iter__(self):
        for value in range(self.n):
            self.produced += 1
            yield torch.tensor([value, self.produced])


class ServedCounter(Dataset):
    """Map-style: item ``i`` is ``[i, served]``, ``served`` counting the items this copy (a worker's) served.

    ``state_dict`` hands out the live dict that it keeps counting in, as datasets may do.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.state = {"served": 0}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        self.state["served"] += 1
        return torch.tensor([index, self.state["served"]])

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = dict(state)


def roundtrip(state: dict) -> dict:
    """``state`` through torch.save and torch.load(weights_only=True), as a checkpoint stores it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def as_lists(batches: Any) -> list:
    return [batch.tolist() for batch in batches]


def values(batches: list) -> list:
    """The first column of ``[value, counter]`` rows."""
    return [[row[0] for row in batch] for batch in batches]
