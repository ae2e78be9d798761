"""``train_sampling_strategy="group_by_length"``: batches of examples of similar lengths, so little is padding.

As transformers' ``LengthGroupedSampler``: each epoch shuffles the examples, cuts the order into megabatches
of ``min(n // (4 * batch_size), 50)`` batches, sorts each megabatch by length (longest first) and moves the
longest example of all to the front (an out-of-memory error shows at the first step). The order depends only
on the seed and the epoch, so every process draws the same one (the prepared loader deals its batches to the
processes) and a resumed run replays the epoch it stopped in exactly.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import Sampler


def length_grouped_indices(lengths: Sequence[int], batch_size: int, generator: torch.Generator) -> list[int]:
    """One epoch's order: shuffled, then sorted by length (descending) within each megabatch."""
    megabatch_batches = max(1, min(len(lengths) // (batch_size * 4), 50))
    size = megabatch_batches * batch_size
    indices = torch.randperm(len(lengths), generator=generator).tolist()
    megabatches = [
        sorted(indices[start : start + size], key=lambda i: lengths[i], reverse=True)
        for start in range(0, len(indices), size)
    ]
    if not megabatches:
        return []
    longest = max(range(len(megabatches)), key=lambda m: lengths[megabatches[m][0]])
    megabatches[0][0], megabatches[longest][0] = megabatches[longest][0], megabatches[0][0]
    return [index for megabatch in megabatches for index in megabatch]


class LengthGroupedSampler(Sampler[int]):
    """Indices in megabatches sorted by length (``group_by_length``); reproducible from ``seed`` and the epoch.

    Args:
        lengths: the length of each example.
        batch_size: the batch size the groups are made for (per device, times the accumulation steps).
        seed: the order of epoch ``e`` is drawn with ``seed + e``.

    Example:
        >>> sampler = LengthGroupedSampler([1, 5, 3, 2], batch_size=2, seed=0)
        >>> sorted(sampler)
        [0, 1, 2, 3]
    """

    def __init__(self, lengths: Sequence[int], batch_size: int, seed: int) -> None:
        self.lengths = list(lengths)
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.lengths)

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose order the next iteration draws (the prepared loader calls it)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator()
        generator.manual_seed((self.seed + self.epoch) % 2**63)
        return iter(length_grouped_indices(self.lengths, self.batch_size, generator))


def dataset_lengths(dataset: Any, column: str, input_name: str) -> list[int]:
    """The lengths: the ``column`` of a ``datasets.Dataset`` (``length_column_name``) when it has one, else
    ``len(example[input_name])`` of each example."""
    names = getattr(dataset, "column_names", None)
    if isinstance(names, list) and column in names:
        return [int(length) for length in dataset[column]]
    if not hasattr(dataset, "__len__"):
        raise ValueError(
            f"TrainingArguments(train_sampling_strategy='group_by_length') needs a map-style dataset with "
            f"lengths; got {type(dataset).__name__}. Use 'random' for an iterable dataset."
        )
    lengths = []
    for index in range(len(dataset)):
        example = dataset[index]
        if not isinstance(example, Mapping) or input_name not in example:
            raise ValueError(
                f"TrainingArguments(train_sampling_strategy='group_by_length') reads each example's length from "
                f"the {column!r} column or from len(example[{input_name!r}]); example {index} is "
                f"{type(example).__name__}{' with keys ' + str(sorted(example)) if isinstance(example, Mapping) else ''}. "
                f"Add a {column!r} column (length_column_name) or a {input_name!r} key."
            )
        lengths.append(len(example[input_name]))
    return lengths
