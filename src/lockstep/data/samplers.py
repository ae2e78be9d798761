"""Samplers that give each process its share of an epoch and can start it at any batch.

Example:
    >>> from torch.utils.data import BatchSampler, SequentialSampler
    >>> batches = BatchSampler(SequentialSampler(range(10)), batch_size=3, drop_last=False)
    >>> list(BatchSamplerShard(batches, num_processes=2, process_index=1))
    [[3, 4, 5], [9, 0, 1]]
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence, Sized
from typing import Any

import torch
from torch.utils.data import BatchSampler, IterableDataset, RandomSampler, SequentialSampler

from lockstep.data._permutation import LazyPermutation
from lockstep.data._sharding import (
    IndexBatches,
    RankBatches,
    ShardSpec,
    iterable_length,
    plan_epoch,
    shard_length,
)


class SeedableRandomSampler(RandomSampler):
    """A ``RandomSampler`` whose order depends only on a seed and the epoch.

    Each epoch draws ``torch.randperm(n, generator=g)`` with ``g`` seeded with ``seed + epoch``, so every
    process and every run sees the same order for the same epoch. Call ``set_epoch`` (or the prepared
    loader's ``set_epoch``) at the start of each epoch.

    Args:
        data_source: the dataset (only its length is used).
        replacement: draw with replacement.
        num_samples: samples per epoch (default: the dataset length).
        generator: the generator to reseed each epoch (default: a new one).
        data_seed: the seed; None takes ``torch.initial_seed()``.

    Example:
        >>> sampler = SeedableRandomSampler(range(4), data_seed=0)
        >>> sampler.set_epoch(1)
        >>> sorted(sampler)
        [0, 1, 2, 3]
    """

    def __init__(
        self,
        data_source: Sized,
        replacement: bool = False,
        num_samples: int | None = None,
        generator: torch.Generator | None = None,
        *,
        data_seed: int | None = None,
    ) -> None:
        super().__init__(data_source, replacement=replacement, num_samples=num_samples, generator=generator)
        self.epoch = 0
        self.initial_seed = int(data_seed) if data_seed is not None else torch.initial_seed()

    def _reseed(self) -> torch.Generator:
        if self.generator is None:
            self.generator = torch.Generator()
        self.generator.manual_seed((self.initial_seed + self.epoch) % 2**64)
        return self.generator

    def __iter__(self) -> Iterator[int]:
        self._reseed()
        yield from super().__iter__()
        self.set_epoch(self.epoch + 1)

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose order the next iteration draws."""
        self.epoch = epoch


class RecordingRandomSampler(RandomSampler):
    """A ``RandomSampler`` without a generator of its own that remembers the seed of its epoch.

    On one process a prepared loader must draw exactly what the plain ``DataLoader`` draws: torch's
    ``RandomSampler`` takes a fresh seed from the global generator at the start of each epoch. This one draws
    it the same way, at the same moment, and records it (``epoch_seed``), so that an epoch resumed from a
    checkpoint replays its order from the recorded seed (``replay_seed``) without drawing again: the global
    generator then continues exactly as in the uninterrupted run.

    Example:
        >>> sampler = RecordingRandomSampler(range(5))
        >>> first = list(sampler)
        >>> sampler.replay_seed = sampler.epoch_seed
        >>> list(sampler) == first
        True
    """

    epoch_seed: int | None = None
    """The seed the current (or last) epoch drew."""
    replay_seed: int | None = None
    """A recorded seed the next epoch uses instead of drawing one (set when resuming mid-epoch)."""
    epoch_state: torch.Tensor | None = None
    """The generator state the current (or last) epoch drew from, when it replayed ``replay_state``."""
    replay_state: torch.Tensor | None = None
    """A generator state at an epoch start the next epoch draws from instead (an epoch resumed on one process
    that several processes began: they shuffle with a generator of their own, whose state was saved)."""

    def draw_generator(self) -> torch.Generator:
        """The epoch's generator, seeded as torch's ``RandomSampler`` seeds it (or from ``replay_seed`` or
        ``replay_state``)."""
        generator = torch.Generator()
        if self.replay_state is not None:
            state, self.replay_state = self.replay_state, None
            generator.set_state(state)
            self.epoch_seed, self.epoch_state = None, state
            return generator
        if self.replay_seed is not None:
            seed, self.replay_seed = self.replay_seed, None
        else:
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
        self.epoch_seed, self.epoch_state = seed, None
        generator.manual_seed(seed)
        return generator

    def __iter__(self) -> Iterator[int]:
        drawing = copy.copy(self)
        drawing.generator = self.draw_generator()
        yield from RandomSampler.__iter__(drawing)


def epoch_indices(sampler: Iterable[int]) -> Sequence[int] | torch.Tensor:
    """The sampler's indices for one epoch, drawn exactly as iterating it would draw them.

    A ``SequentialSampler`` costs nothing and a ``RandomSampler`` without replacement gives a
    :class:`LazyPermutation` (the same ``randperm`` calls, on the same generator and at the same moments, as
    its ``__iter__``); any other sampler is iterated.
    """
    if type(sampler) is SequentialSampler:
        return range(len(sampler.data_source))  # type: ignore[arg-type]
    plain_random = (RandomSampler, SeedableRandomSampler, RecordingRandomSampler)
    if type(sampler) in plain_random and not sampler.replacement:  # type: ignore[attr-defined]
        return _permutation(sampler)  # type: ignore[arg-type]
    return list(sampler)


def _permutation(sampler: RandomSampler) -> LazyPermutation:
    if isinstance(sampler, SeedableRandomSampler):
        generator = sampler._reseed()
    elif isinstance(sampler, RecordingRandomSampler):
        generator = sampler.draw_generator()
    elif sampler.generator is None:  # RandomSampler draws a fresh seed from the global generator
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
        generator = torch.Generator()
        generator.manual_seed(seed)
    else:
        generator = sampler.generator
    permutation = LazyPermutation(generator, len(sampler.data_source), sampler.num_samples)  # type: ignore[arg-type]
    if isinstance(sampler, SeedableRandomSampler):
        sampler.set_epoch(sampler.epoch + 1)
    return permutation


def global_batches(batch_sampler: Iterable[list[int]]) -> Sequence[Sequence[int]]:
    """The epoch's global batches: built on demand for a plain ``BatchSampler``, else listed."""
    if type(batch_sampler) is BatchSampler and isinstance(batch_sampler.sampler, Sized):
        indices = epoch_indices(batch_sampler.sampler)
        return IndexBatches(indices, batch_sampler.batch_size, drop_last=batch_sampler.drop_last)
    return [list(batch) for batch in batch_sampler]


def process_share(
    batches: Sequence[Sequence[int]],
    batch_sampler: Any,
    *,
    process: int,
    processes: int,
    even_batches: bool = True,
) -> RankBatches:
    """Process ``process``'s batches of an epoch whose global batches are ``batches`` (from
    ``batch_sampler``, whose ``batch_size`` and ``drop_last`` apply), dealt over ``processes`` as
    :class:`BatchSamplerShard` deals them without ``split_batches``. Its ``remainder`` is the number of real
    samples in the last round (what ``gather_for_metrics`` keeps of it)."""
    spec = ShardSpec(
        world_size=processes,
        rank=process,
        even_batches=even_batches,
        drop_last=bool(getattr(batch_sampler, "drop_last", False)),
        batch_size=getattr(batch_sampler, "batch_size", None),
    )
    return plan_epoch(batches, spec)


class BatchSamplerShard(BatchSampler):
    """Wraps a batch sampler so that it yields one process's batches only (Accelerate's rules).

    With ``split_batches=False`` process ``i`` takes global batches ``i, i+N, ...``; with ``True`` each
    batch is cut into ``N`` slices. ``even_batches`` repeats samples from the start of the epoch so every
    process gets the same number of full batches. See :mod:`lockstep.data._sharding` for the exact rules.

    Args:
        batch_sampler: the batch sampler to shard.
        num_processes: number of processes.
        process_index: this process's index.
        split_batches: cut batches instead of dealing them out.
        even_batches: complete the last round with samples from the start of the epoch.
        start_batch: skip this many of this process's batches at the start of every iteration (O(1) for a
            plain ``BatchSampler``); a prepared dataloader sets it to resume.
        start_global: the global batches of the epoch already consumed before this process's share is dealt;
            a prepared dataloader sets it to resume an epoch begun on another number of processes.

    Attributes:
        remainder: real samples in the last global round of the latest epoch (-1 before the first one or
            when unknown).
        current_plan: this process's batches of the latest epoch (None before the first one).

    Example:
        >>> from torch.utils.data import BatchSampler, SequentialSampler
        >>> batches = BatchSampler(SequentialSampler(range(8)), batch_size=4, drop_last=False)
        >>> list(BatchSamplerShard(batches, num_processes=2, process_index=0, split_batches=True))
        [[0, 1], [4, 5]]
    """

    def __init__(
        self,
        batch_sampler: Iterable[list[int]],
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
        even_batches: bool = True,
        *,
        start_batch: int = 0,
        start_global: int = 0,
    ) -> None:
        # BatchSampler.__init__ is not called: it wants a sampler and a batch size we may not have.
        self.batch_sampler = batch_sampler
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.batch_size = getattr(batch_sampler, "batch_size", None)
        self.drop_last = getattr(batch_sampler, "drop_last", False)
        self.start_batch = start_batch
        self.start_global = start_global
        self.remainder = -1
        self.current_plan: RankBatches | None = None
        _ = self.spec  # validate now, not at the first iteration

    @property
    def spec(self) -> ShardSpec:
        """The sharding rules, from the current attributes."""
        return ShardSpec(
            world_size=self.num_processes,
            rank=self.process_index,
            split_batches=self.split_batches,
            even_batches=self.even_batches,
            drop_last=self.drop_last,
            batch_size=self.batch_size,
        )

    @property
    def sampler(self) -> Any:
        """The sampler of the wrapped batch sampler (None when it has none)."""
        return getattr(self.batch_sampler, "sampler", None)

    @sampler.setter
    def sampler(self, value: Any) -> None:
        self.batch_sampler.sampler = value  # type: ignore[attr-defined]

    @property
    def total_length(self) -> int:
        """Global batches per epoch."""
        return len(self.batch_sampler)  # type: ignore[arg-type]

    def epoch_length(self) -> int:
        """This process's batches per epoch, ignoring ``start_batch`` (counted from ``start_global``)."""
        inner = self.batch_sampler
        if type(inner) is BatchSampler and isinstance(inner.sampler, Sized):
            num_samples, size = len(inner.sampler), inner.batch_size
            count = num_samples // size if inner.drop_last else -(-num_samples // size)
            last = num_samples - (count - 1) * size if count else None
            remaining = max(0, count - self.start_global)
            return shard_length(remaining, self.spec, last_batch_size=last if remaining else None)
        return shard_length(max(0, len(inner) - self.start_global), self.spec)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return max(0, self.epoch_length() - self.start_batch)

    def set_epoch(self, epoch: int) -> None:
        """Forward the epoch to the wrapped batch sampler, or to its sampler."""
        if hasattr(self.batch_sampler, "set_epoch"):
            self.batch_sampler.set_epoch(epoch)
        elif hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def plan_epoch(self) -> RankBatches:
        """Draw the next epoch of the wrapped sampler and compute this process's batches."""
        plan = plan_epoch(global_batches(self.batch_sampler), self.spec, start=self.start_global)
        self.remainder, self.current_plan = plan.remainder, plan
        return plan

    def __iter__(self) -> Iterator[list[int]]:
        yield from self.plan_epoch().iter_from(self.start_batch)


class IterableDatasetShard(IterableDataset):
    """Wraps an iterable dataset so that it yields one process's samples only (Accelerate's rules).

    Samples are buffered ``batch_size * num_processes`` at a time (``batch_size`` with ``split_batches``)
    and each process yields its contiguous slice of the buffer. At the end, unless ``drop_last``, the
    last buffer is completed with samples from the first one.

    Args:
        dataset: the iterable dataset.
        batch_size: batch size per process, or the global batch size with ``split_batches``.
        drop_last: drop the last incomplete buffer instead of completing it.
        num_processes: number of processes.
        process_index: this process's index.
        split_batches: ``batch_size`` is the global batch size, cut across processes.

    Attributes:
        remainder: real samples in the last buffer of the latest epoch (-1 until an epoch ends).

    The shard has ``state_dict`` / ``load_state_dict`` for torchdata's ``StatefulDataLoader``, which calls
    them between batches (``use_stateful_dataloader=True``): a wrapped dataset with a state of its own
    resumes from it, any other is read again up to the saved round.

    Example:
        >>> list(IterableDatasetShard(range(6), batch_size=2, num_processes=2, process_index=1))
        [2, 3, 0, 1]
    """

    _rounds: int = 0  # buffers read from the wrapped dataset this epoch
    _first: list[Any] | None = None  # the epoch's first buffer, which completes a short last one
    _resume: tuple[int, list[Any] | None, bool] | None = None  # from load_state_dict, for the next __iter__

    def __init__(
        self,
        dataset: Iterable[Any],
        batch_size: int = 1,
        drop_last: bool = False,
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
    ) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(
                f"IterableDatasetShard(batch_size={batch_size!r}) is invalid: it must be an int >= 1."
            )
        ShardSpec(
            world_size=num_processes, rank=process_index, split_batches=split_batches, batch_size=batch_size
        )
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.epoch = 0
        self.remainder = -1

    def set_epoch(self, epoch: int) -> None:
        """Remember the epoch and forward it to the dataset."""
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    @property
    def total_length(self) -> int:
        """Samples in the wrapped dataset."""
        return len(self.dataset)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return iterable_length(
            len(self.dataset),  # type: ignore[arg-type]
            batch_size=self.batch_size,
            world_size=self.num_processes,
            split_batches=self.split_batches,
            drop_last=self.drop_last,
        )

    def __iter__(self) -> Iterator[Any]:
        rounds, first, restored = self._resume or (0, None, False)
        self._resume = None
        generator = getattr(self.dataset, "generator", None)
        if not restored and not hasattr(self.dataset, "set_epoch") and isinstance(generator, torch.Generator):
            generator.manual_seed(self.epoch)
        round_size = self.batch_size if self.split_batches else self.batch_size * self.num_processes
        per_rank = round_size // self.num_processes if self.split_batches else self.batch_size
        mine = slice(self.process_index * per_rank, (self.process_index + 1) * per_rank)
        self.remainder = -1
        self._rounds, self._first = rounds, first
        items = iter(self.dataset)
        if not restored:  # read again up to where the state was taken
            for _ in itertools.islice(items, rounds * round_size):
                pass
        yield from self._deal(items, round_size, mine)

    def _deal(self, items: Iterator[Any], round_size: int, mine: slice) -> Iterator[Any]:
        buffer: list[Any] = []
        for item in items:
            buffer.append(item)
            if len(buffer) == round_size:
                # Counted before yielding: a state taken between two batches has the whole buffer read.
                self._rounds += 1
                self._first = buffer if self._first is None else self._first
                yield from buffer[mine]
                buffer = []
        if buffer and not self.drop_last:
            source = self._first if self._first is not None else list(buffer)
            self.remainder = len(buffer)
            self._rounds += 1
            padded = buffer + [source[j % len(source)] for j in range(round_size - len(buffer))]
            yield from padded[mine]
        else:
            self.remainder = round_size if self._first is not None else 0

    # -- state, for torchdata's StatefulDataLoader ----------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where this epoch's stream is: the rounds read, the wrapped dataset's own state (None when it has
        none) and the first round (None with ``drop_last``), which completes a short last round."""
        return {
            "rounds": self._rounds,
            "dataset": self.dataset.state_dict() if _has_state(self.dataset) else None,  # type: ignore[attr-defined]
            "first_round": None if self._first is None or self.drop_last else list(self._first),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume the next iteration where ``state_dict`` was taken.

        The wrapped dataset's own state is loaded now (it then resumes by itself); without one, the next
        iteration reads the wrapped dataset again up to the saved round.
        """
        restored = state_dict.get("dataset") is not None and _has_state(self.dataset)
        if restored:
            self.dataset.load_state_dict(state_dict["dataset"])  # type: ignore[attr-defined]
        self._resume = (int(state_dict["rounds"]), state_dict.get("first_round"), restored)


def _has_state(obj: Any) -> bool:
    """Whether ``obj`` saves and restores its own position (torchdata's ``Stateful`` protocol)."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
