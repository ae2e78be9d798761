"""A ``RandomSampler``'s epoch drawn lazily, exactly when torch's ``RandomSampler.__iter__`` draws it.

torch draws one ``randperm`` per pass over the data, each when the previous one is used up; a prepared
loader plans its epoch from indices, and :class:`LazyPermutation` lets it read them without drawing ahead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class LazyPermutation(Sequence[int]):
    """A ``RandomSampler``'s epoch (without replacement), drawn when and as torch's ``__iter__`` draws it.

    torch draws one ``randperm(n)`` per whole pass over the data, then one more cut to ``num_samples % n``
    (possibly empty); each is drawn when the sampler is asked for its first index, the last one at the
    latest when the sampler is asked for the index past the end. So an epoch broken off early leaves the
    generator where plain PyTorch leaves it: drawing everything at the start would move it further.

    Args:
        generator: the generator to draw from.
        n: samples in the dataset.
        num_samples: indices in the epoch.

    Example:
        >>> indices = LazyPermutation(torch.Generator().manual_seed(0), 3, 5)
        >>> len(indices._chunks), sorted(indices[:3].tolist()), len(indices._chunks)
        (0, [0, 1, 2], 1)
    """

    def __init__(self, generator: torch.Generator, n: int, num_samples: int) -> None:
        self._generator = generator
        self._n = n
        self._num_samples = num_samples
        self._last_chunk = num_samples // n  # the remainder's permutation
        self._chunks: list[torch.Tensor] = []
        self._drawn = torch.empty(0, dtype=torch.int64)

    def __len__(self) -> int:
        return self._num_samples

    def touch(self, position: int) -> None:
        """Draw what torch has drawn once the sampler was asked for index ``position`` (``len(self)``:
        asked for one past the end, i.e. it ran out)."""
        needed = min(position // self._n, self._last_chunk)
        if len(self._chunks) > needed:
            return
        while len(self._chunks) <= needed:
            chunk = torch.randperm(self._n, generator=self._generator)
            if len(self._chunks) == self._last_chunk:
                chunk = chunk[: self._num_samples % self._n]
            self._chunks.append(chunk)
        self._drawn = torch.cat(self._chunks)

    def __getitem__(self, index: int | slice) -> Any:  # type: ignore[override]
        if isinstance(index, slice):
            span = range(*index.indices(self._num_samples))
            if span:
                self.touch(max(span[0], span[-1]))
            return self._drawn[index]
        if index < 0:
            index += self._num_samples
        if not 0 <= index < self._num_samples:
            raise IndexError(f"index {index} out of range for {self._num_samples} samples")
        self.touch(index)
        return int(self._drawn[index])
