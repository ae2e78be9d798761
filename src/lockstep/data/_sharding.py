"""Which batches each rank reads in one epoch: pure index arithmetic, no torch.distributed.

The input is the list of global batches the original batch sampler produced for the epoch; the output
is one rank's list, with exactly the rules of Accelerate's ``BatchSamplerShard``:

* **no split** -- rank ``r`` of ``N`` takes global batches ``r, r+N, r+2N, ...``. A round of ``N``
  batches is only handed out once the round's last batch is full. At the end (unless ``drop_last``),
  ``even_batches`` completes the short tail with samples cycled from the start of the epoch (the first
  ``N`` batches) so every rank gets the same number of full batches; without it a rank gets its partial
  batch or nothing.
* **split** -- every global batch of size ``B`` is cut into ``N`` contiguous slices of ``B / N``. A short
  last batch is completed from the first batch of the epoch under ``even_batches``; without it a rank
  gets its slice of it when that slice is not empty.

The regular case (every batch full but maybe the last) is computed arithmetically, so that batch ``k``
of a rank costs O(batch size) and resuming at batch ``k`` never walks through the skipped batches.
Irregular batch lists (custom batch samplers) replay Accelerate's streaming algorithm step by step.

Example:
    >>> spec = ShardSpec(world_size=2, rank=1, batch_size=3)
    >>> list(plan_epoch(IndexBatches(range(10), 3, drop_last=False), spec))
    [[3, 4, 5], [9, 0, 1]]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class ShardSpec:
    """How one rank reads its share of an epoch."""

    world_size: int = 1
    """Number of processes sharing the data."""
    rank: int = 0
    """This process's index, in ``[0, world_size)``."""
    split_batches: bool = False
    """Cut each global batch into ``world_size`` slices instead of handing out whole batches."""
    even_batches: bool = True
    """Repeat samples from the start of the epoch so that every rank gets as many batches."""
    drop_last: bool = False
    """The original batch sampler drops its last incomplete batch (no padding happens then)."""
    batch_size: int | None = None
    """Size of a full global batch of the original batch sampler; None when unknown."""

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"process_index={self.rank} with num_processes={self.world_size} is invalid: the number of "
                "processes must be >= 1 and the index in [0, num_processes)."
            )
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size} is invalid: it must be >= 1.")
        if self.split_batches and self.batch_size is None:
            raise ValueError(
                "split_batches=True needs the batch size, to cut each batch into equal slices, but the batch "
                "sampler has no `batch_size` attribute. Give it one, or pass split_batches=False."
            )
        if self.split_batches and self.batch_size % self.world_size != 0:  # type: ignore[operator]
            raise ValueError(
                f"split_batches=True needs the batch size ({self.batch_size}) to be a round multiple of the "
                f"number of processes ({self.world_size}), since each batch is cut into {self.world_size} equal "
                "slices. Change the batch size, or pass split_batches=False."
            )
        if self.even_batches and self.batch_size is None:
            raise ValueError(
                "even_batches=True needs the batch size of the batch sampler, to know how many samples to "
                "repeat, but the batch sampler has no `batch_size`. Pass even_batches=False (the Accelerator "
                "takes DataLoaderConfiguration(even_batches=False))."
            )

    @property
    def total_batch_size(self) -> int | None:
        """Samples in one global round: ``batch_size`` when splitting, else ``batch_size * world_size``."""
        if self.batch_size is None:
            return None
        return self.batch_size if self.split_batches else self.batch_size * self.world_size


class IndexBatches(Sequence[list[int]]):
    """The batches a ``torch.utils.data.BatchSampler`` makes of a flat index sequence, built on demand.

    Args:
        indices: the sampler's indices for the epoch (a ``range``, a list or a 1-D tensor).
        batch_size: samples per batch.
        drop_last: leave out the last incomplete batch.
    """

    def __init__(self, indices: Sequence[int] | Any, batch_size: int, *, drop_last: bool) -> None:
        self.indices = indices
        self.batch_size = batch_size
        self.num_samples = len(indices)
        whole, rest = divmod(self.num_samples, batch_size)
        self._length = whole if drop_last or rest == 0 else whole + 1

    def __len__(self) -> int:
        return self._length

    def touch(self, index: int) -> None:
        """Make a lazily drawn index sequence draw what torch's ``BatchSampler`` has drawn from its sampler
        once it made batch ``index`` (``len(self)``: once it ran out). A short last batch is made when the
        sampler has run out."""
        touch = getattr(self.indices, "touch", None)
        if touch is None:
            return
        end = (index + 1) * self.batch_size
        touch(self.num_samples if index >= self._length or end > self.num_samples else end - 1)

    def batch_length(self, index: int) -> int:
        """Samples in batch ``index``, without reading it."""
        return min(self.batch_size, self.num_samples - index * self.batch_size)

    def __getitem__(self, index: int) -> list[int]:  # type: ignore[override]
        if index < 0:
            index += self._length
        if not 0 <= index < self._length:
            raise IndexError(f"batch {index} out of range for {self._length} batches")
        self.touch(index)
        chunk = self.indices[index * self.batch_size : (index + 1) * self.batch_size]
        return chunk.tolist() if hasattr(chunk, "tolist") else list(chunk)


class RankBatches(Sequence[list[int]]):
    """One rank's batches for one epoch.

    Batch ``k`` is computed when asked for, so ``iter_from(k)`` is O(1) in ``k``; the padded last batch
    too, so that a lazily drawn epoch (:class:`~lockstep.data.samplers.LazyPermutation`) draws nothing
    before it is needed.

    Attributes:
        remainder: real (not repeated) samples in the last global round; the full round size when it is
            full, 0 for an empty epoch, -1 when unknown (irregular batches).
    """

    def __init__(
        self,
        head: Callable[[int], list[int]],
        head_length: int,
        tail: Callable[[], list[int]] | None,
        *,
        remainder: int,
        on_end: Callable[[], None] | None = None,
    ) -> None:
        self._head = head
        self._head_length = head_length
        self._tail = tail
        self._on_end = on_end
        self.remainder = remainder

    @classmethod
    def from_list(cls, batches: list[list[int]], *, remainder: int) -> RankBatches:
        return cls(batches.__getitem__, len(batches), None, remainder=remainder)

    def __len__(self) -> int:
        return self._head_length + (self._tail is not None)

    def __getitem__(self, index: int) -> list[int]:  # type: ignore[override]
        length = len(self)
        if index < 0:
            index += length
        if not 0 <= index < length:
            raise IndexError(f"batch {index} out of range for {length} batches")
        if index < self._head_length:
            return self._head(index)
        assert self._tail is not None
        return self._tail()

    def __iter__(self) -> Iterator[list[int]]:
        return self.iter_from(0)

    def iter_from(self, start: int) -> Iterator[list[int]]:
        """The batches from number ``start`` on (nothing when ``start >= len(self)``)."""
        for index in range(max(start, 0), len(self)):
            yield self[index]
        if self._on_end is not None:  # asked for one more: the original sampler runs out here
            self._on_end()


def plan_epoch(global_batches: Sequence[Sequence[int]], spec: ShardSpec, *, start: int = 0) -> RankBatches:
    """This rank's batches for the epoch whose global batches are ``global_batches``.

    ``start`` global batches were consumed already (by an attempt on another number of processes): the
    rules deal the epoch's batches from number ``start`` on, as if the epoch began there, except that a short
    last round is still completed from the epoch's first batches.
    """
    if not _is_regular(global_batches, spec.batch_size):
        batches = list(global_batches)[start:]
        return RankBatches.from_list(simulate_shard(batches, spec), remainder=-1)
    if spec.split_batches:
        return _plan_split(global_batches, spec, start)
    return _plan_no_split(global_batches, spec, start)


def _is_regular(batches: Sequence[Sequence[int]], batch_size: int | None) -> bool:
    """Every batch full except maybe the last, which is not empty."""
    if batch_size is None:
        return False
    if isinstance(batches, IndexBatches):
        return batches.batch_size == batch_size
    if not batches:
        return True
    return all(len(b) == batch_size for b in batches[:-1]) and 0 < len(batches[-1]) <= batch_size


def _touch(batches: Sequence[Sequence[int]], index: int) -> None:
    """Draw what the original batch sampler has drawn once it made batch ``index`` (only lazily drawn
    epochs draw anything; see :meth:`IndexBatches.touch`). The original batch sampler of a rank's batch
    ``k`` is read to the end of the round, as Accelerate's ``BatchSamplerShard`` reads it."""
    if isinstance(batches, IndexBatches):
        batches.touch(index)


def _length_of(batches: Sequence[Sequence[int]], index: int) -> int:
    """Samples in batch ``index``, without drawing it."""
    if isinstance(batches, IndexBatches):
        return batches.batch_length(index)
    return len(batches[index])


def _cycle_fill(real: list[int], source: list[int], size: int) -> list[int]:
    """``real`` followed by ``source`` repeated from its start, ``size`` items in all."""
    return real + [source[j % len(source)] for j in range(size - len(real))]


def _plan_no_split(batches: Sequence[Sequence[int]], spec: ShardSpec, start: int = 0) -> RankBatches:
    world, rank, size = spec.world_size, spec.rank, spec.batch_size
    assert size is not None
    total = len(batches)
    start = min(max(start, 0), total)
    count = total - start  # the batches still to deal
    partial = int(count > 0 and _length_of(batches, total - 1) < size)
    full_rounds = (count - partial) // world
    leftover = count - full_rounds * world

    def head(k: int) -> list[int]:
        _touch(batches, start + (k + 1) * world - 1)
        return list(batches[start + k * world + rank])

    def run_out() -> None:
        _touch(batches, total)

    if spec.drop_last or leftover == 0:
        return RankBatches(
            head, full_rounds, None, remainder=world * size if full_rounds else 0, on_end=run_out
        )
    real_count = (leftover - 1) * size + _length_of(batches, total - 1)

    def padded() -> list[int]:
        run_out()  # the last round is dealt once the original sampler has run out
        real = [i for j in range(start + full_rounds * world, total) for i in batches[j]]
        first = [i for j in range(min(world, total)) for i in batches[j]]
        return _cycle_fill(real, first, world * size)[rank * size : (rank + 1) * size]

    def own() -> list[int]:
        run_out()
        return list(batches[start + full_rounds * world + rank])

    if spec.even_batches:
        tail: Callable[[], list[int]] | None = padded
    else:
        tail = own if rank < leftover else None
    return RankBatches(head, full_rounds, tail, remainder=real_count, on_end=run_out)


def _plan_split(batches: Sequence[Sequence[int]], spec: ShardSpec, offset: int = 0) -> RankBatches:
    size = spec.batch_size
    assert size is not None
    piece = size // spec.world_size
    start, stop = spec.rank * piece, (spec.rank + 1) * piece
    total = len(batches)
    offset = min(max(offset, 0), total)
    count = total - offset  # the batches still to deal
    last_length = _length_of(batches, total - 1) if count else 0
    partial = int(count > 0 and last_length < size)
    full = count - partial

    def head(k: int) -> list[int]:
        return list(batches[offset + k][start:stop])

    def run_out() -> None:
        _touch(batches, total)

    if spec.drop_last or not partial:
        return RankBatches(head, full, None, remainder=size if full else 0, on_end=run_out)

    def last() -> list[int]:
        run_out()
        batch = list(batches[total - 1])
        return (
            _cycle_fill(batch, list(batches[0]), size)[start:stop] if spec.even_batches else batch[start:stop]
        )

    has_tail = spec.even_batches or last_length > start
    return RankBatches(head, full, last if has_tail else None, remainder=last_length, on_end=run_out)


def shard_length(num_batches: int, spec: ShardSpec, *, last_batch_size: int | None = None) -> int:
    """Batches a rank reads per epoch, from the number of global batches (Accelerate's formula).

    Args:
        num_batches: global batches per epoch (``len`` of the original batch sampler).
        spec: how this rank reads.
        last_batch_size: size of the last global batch, when known. It corrects the one case where
            Accelerate's ``BatchSamplerShard.__len__`` over-counts: with ``split_batches=True`` and
            ``even_batches=False``, a rank whose slice of a short last batch is empty reads one batch less.
    """
    world, rank = spec.world_size, spec.rank
    if spec.split_batches:
        length = num_batches
        piece = (spec.batch_size or 0) // world
        short = last_batch_size is not None and num_batches > 0 and last_batch_size < (spec.batch_size or 0)
        if short and not spec.even_batches and not spec.drop_last and last_batch_size <= piece * rank:
            length -= 1
        return length
    whole, rest = divmod(num_batches, world)
    if rest == 0 or spec.drop_last:
        return whole
    if spec.even_batches:
        return whole + 1
    return whole + 1 if rank < rest else whole


def simulate_shard(global_batches: Sequence[Sequence[int]], spec: ShardSpec) -> list[list[int]]:
    """Accelerate's streaming sharding, replayed batch by batch: the reference for irregular batches."""
    batches = [list(b) for b in global_batches]
    if spec.split_batches:
        return _simulate_split(batches, spec)
    return _simulate_no_split(batches, spec)


def _simulate_no_split(batches: list[list[int]], spec: ShardSpec) -> list[list[int]]:
    world, rank, size = spec.world_size, spec.rank, spec.batch_size
    out: list[list[int]] = []
    first: list[int] = []
    pending: list[int] = []
    index, batch = -1, []
    for index, batch in enumerate(batches):
        if not spec.drop_last and index < world:
            first += batch
        if index % world == rank:
            pending = batch
        if index % world == world - 1 and (size is None or len(batch) == size):
            out.append(pending)
            pending = []
    if spec.drop_last or not first:
        return out
    if not spec.even_batches:
        return [*out, pending] if pending else out
    assert size is not None
    if len(pending) == size:
        out.append(pending)
    while len(first) < world * size:
        first = first + first
    if len(batch) == size:
        batch, index = [], index + 1
    cursor = 0
    while index % world != 0 or batch:
        end = cursor + size - len(batch)
        batch = batch + first[cursor:end]
        if index % world == rank:
            out.append(batch)
        cursor, batch, index = end, [], index + 1
    return out


def _simulate_split(batches: list[list[int]], spec: ShardSpec) -> list[list[int]]:
    size = spec.batch_size
    assert size is not None
    piece = size // spec.world_size
    start, stop = spec.rank * piece, (spec.rank + 1) * piece
    out = [batch[start:stop] for batch in batches if len(batch) == size]
    if spec.drop_last or not batches or not batches[0] or len(batches[-1]) >= size:
        return out
    last = batches[-1]
    if not spec.even_batches:
        return [*out, last[start:stop]] if len(last) > start else out
    first = list(batches[0])
    while len(first) < size:
        first = first + first
    return [*out, (last + first)[start:stop]]


def iterable_length(
    num_samples: int, *, batch_size: int, world_size: int, split_batches: bool, drop_last: bool
) -> int:
    """Samples one rank of an ``IterableDatasetShard`` yields per epoch."""
    round_size = batch_size if split_batches else batch_size * world_size
    per_rank = batch_size // world_size if split_batches else batch_size
    rounds = num_samples // round_size if drop_last else math.ceil(num_samples / round_size)
    return rounds * per_rank
