"""Prepared dataloaders: device placement, end-of-epoch look-ahead and a resumable position.

A prepared loader reads one batch ahead, so that ``end_of_dataloader`` is already True while the last
batch of the epoch is processed (gradient accumulation syncs there, ``gather_for_metrics`` drops the
repeated samples there). It registers itself with :class:`~lockstep.state.GradientState` for the
duration of an iteration and records where it is, so that ``state_dict()`` / ``load_state_dict()``
resume at the next unseen batch of the same epoch, in the same order, on every rank.

State dict format (plain ints, strings and tensors; loads with ``torch.load(weights_only=True)``)::

    {
        "epoch": int,                 # the epoch the next iteration reads
        "batches_yielded": int,       # this process's batches already read in that epoch
        "total_batch_size": int,      # samples per global step (-1 if unknown)
        "num_processes": int,
        "sampler_seed": int,          # seed of a SeedableRandomSampler (-1 if none)
        "generator_state": Tensor,    # only with a shuffling generator: its state at the epoch start
    }
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lockstep._nested import find_batch_size, send_to_device
from lockstep.data.samplers import BatchSamplerShard, IterableDatasetShard, SeedableRandomSampler
from lockstep.rng import synchronize_rng_states
from lockstep.state import GradientState


def batch_length(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor, else the length of its first list."""
    size = find_batch_size(batch)
    if size is not None:
        return size
    if isinstance(batch, Mapping):
        batch = next(iter(batch.values()), [])
    elif isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], (list, tuple, Mapping)):
        return batch_length(batch[0])
    return len(batch) if hasattr(batch, "__len__") else 1


def _lookahead(batches: Iterator[Any]) -> Iterator[tuple[Any, bool]]:
    """Each item with a flag that says whether it is the last one."""
    try:
        current = next(batches)
    except StopIteration:
        return
    for following in batches:
        yield current, False
        current = following
    yield current, True


class DataLoaderStateMixin:
    """End-of-epoch flag, GradientState registration and the resumable position of a prepared loader.

    Attributes:
        end_of_dataloader: True while the last batch of the current epoch is processed.
        iteration: the epoch that the current (or next) iteration reads.
        skip_batches: batches skipped at the start of every epoch (see ``skip_first_batches``).
    """

    end_of_dataloader: bool = False
    iteration: int = 0
    skip_batches: int = 0
    _batches_yielded: int = 0
    _in_epoch: bool = False
    _pending_skip: int | None = None
    _epoch_start_state: torch.Tensor | None = None
    _epoch_base_seed: int | None = None
    _resume_mid_epoch: bool = False
    _resume_base_seed: int | None = None
    _seed_synced: bool = False
    _step_observer: Any = None  # the Accelerator's step timer (lockstep.throughput), when step timing is on

    # -- hooks ------------------------------------------------------------------------------------
    def _order_sampler(self) -> Any:
        """The sampler that decides the order of the epoch (None for iterable datasets)."""
        return None

    def _replay_generator(self) -> torch.Generator | None:
        """The generator whose state at the epoch start determines the epoch's order."""
        return None

    def _synchronize(self) -> None:
        """Make every rank draw the same order this epoch."""

    def _on_begin(self) -> None:
        """Reset per-epoch attributes."""

    @property
    def gradient_state(self) -> GradientState:
        """The shared GradientState (looked up each time, so a reset between runs is seen)."""
        return GradientState()

    @property
    def total_batch_size(self) -> int | None:
        """Samples per step across all processes (None when unknown)."""
        raise NotImplementedError

    # -- epoch bookkeeping ------------------------------------------------------------------------
    def _seedable_sampler(self) -> SeedableRandomSampler | None:
        sampler = self._order_sampler()
        return sampler if isinstance(sampler, SeedableRandomSampler) else None

    def _forward_epoch(self, epoch: int) -> None:
        holder = getattr(self, "batch_sampler", None)
        if holder is None:
            holder = getattr(self, "sampler", None)
        if isinstance(holder, BatchSamplerShard):
            if hasattr(holder.batch_sampler, "set_epoch") or hasattr(holder.sampler, "set_epoch"):
                holder.set_epoch(epoch)
                return
        elif hasattr(getattr(holder, "sampler", None), "set_epoch"):
            holder.sampler.set_epoch(epoch)  # type: ignore[union-attr]
            return
        if hasattr(getattr(self, "dataset", None), "set_epoch"):
            self.dataset.set_epoch(epoch)  # type: ignore[attr-defined]

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch that the next iteration reads (and forward it to the sampler or dataset)."""
        self.iteration = epoch
        self._forward_epoch(epoch)

    def _begin_epoch(self) -> int:
        """Start an iteration; returns how many of this process's batches to skip."""
        self.end_of_dataloader = False
        skip = self.skip_batches if self._pending_skip is None else self._pending_skip
        self._pending_skip = None
        self._on_begin()
        self._forward_epoch(self.iteration)
        self._synchronize()
        generator = self._replay_generator()
        self._epoch_start_state = None if generator is None else generator.get_state()
        self._batches_yielded = skip
        self._in_epoch = True
        self.gradient_state._add_dataloader(self)
        return skip

    def _track(self, batches: Iterator[Any]) -> Iterator[Any]:
        """Yield ``batches`` one ahead, keeping ``end_of_dataloader`` and the position up to date."""
        tracked = self._track_position(batches)
        observer = self._step_observer
        return tracked if observer is None else observer.time_batches(tracked)

    def _track_position(self, batches: Iterator[Any]) -> Iterator[Any]:
        for batch, is_last in _lookahead(batches):
            self.end_of_dataloader = is_last
            if is_last:
                self._last_batch_length = batch_length(batch)
            self._batches_yielded += 1
            yield batch
        self.iteration += 1
        self._batches_yielded = 0
        self._in_epoch = False

    def _end_epoch(self) -> None:
        self.gradient_state._remove_dataloader(self)

    def begin(self) -> None:
        """Accelerate compatibility: reset the flags and register with the GradientState."""
        self.end_of_dataloader = False
        self.gradient_state._add_dataloader(self)

    def end(self) -> None:
        """Accelerate compatibility: unregister from the GradientState."""
        self._end_epoch()

    # -- position ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where this loader is: enough to resume at the next unseen batch (format in the module doc)."""
        generator = self._replay_generator()
        current = None if generator is None else generator.get_state()
        if self._in_epoch and not self.end_of_dataloader:
            epoch, position, state = self.iteration, self._batches_yielded, self._epoch_start_state
        elif self._in_epoch:  # the last batch is out: resuming starts the next epoch
            epoch, position, state = self.iteration + 1, 0, current
        else:
            epoch, position, state = self.iteration, self._pending_skip or 0, current
        seedable = self._seedable_sampler()
        result: dict[str, Any] = {
            "epoch": int(epoch),
            "batches_yielded": int(position),
            "total_batch_size": int(self.total_batch_size or -1),
            "num_processes": int(getattr(self, "_world", 1)),
            "sampler_seed": int(seedable.initial_seed) if seedable is not None else -1,
        }
        if state is not None:
            result["generator_state"] = state.clone()
        if position > 0 and self._epoch_base_seed is not None:
            result["base_seed"] = int(self._epoch_base_seed)
        return result

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume where ``state_dict`` was taken: the next iteration starts at the next unseen batch."""
        missing = [key for key in ("epoch", "batches_yielded") if key not in state_dict]
        if missing:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict() got a dict without {missing} (keys: "
                f"{sorted(state_dict)}); pass a dict returned by a prepared loader's state_dict()."
            )
        position = int(state_dict["batches_yielded"])
        saved_total, total = int(state_dict.get("total_batch_size", -1)), self.total_batch_size
        if saved_total > 0 and total and saved_total != total:
            seen = position * saved_total
            position = seen // total
            warnings.warn(
                f"The dataloader state was saved with {saved_total} samples per step and this loader takes "
                f"{total}: resuming at batch {position} of the epoch, which re-reads {seen - position * total} "
                f"of the {seen} samples already seen.",
                stacklevel=2,
            )
        self.iteration = int(state_dict["epoch"])
        self._pending_skip = position
        self._resume_mid_epoch = position > 0
        self._resume_base_seed = (
            int(state_dict["base_seed"]) if position > 0 and "base_seed" in state_dict else None
        )
        self._in_epoch = False
        self.end_of_dataloader = False
        seedable, seed = self._seedable_sampler(), int(state_dict.get("sampler_seed", -1))
        if seedable is not None and seed >= 0:
            seedable.initial_seed = seed
            self._seed_synced = True
        generator, state = self._replay_generator(), state_dict.get("generator_state")
        if generator is not None and state is not None:
            generator.set_state(state)


class DataLoaderShard(DataLoader, DataLoaderStateMixin):
    """A DataLoader that reads one process's share of the data, optionally moving it to a device.

    Build it with :func:`~lockstep.data.prepare_data_loader` rather than directly.

    Args:
        dataset: the dataset (an ``IterableDatasetShard`` for sharded iterable data).
        device: move each batch there (None: leave it where the collate function put it).
        rng_types: generators to copy from rank 0 at the start of each epoch (``"generator"``,
            ``"torch"``, ``"cuda"``, ...).
        synchronized_generator: the generator that ``"generator"`` refers to; by default the sampler's.
        skip_batches: skip this many of this process's batches at the start of every epoch.
        **kwargs: the ``torch.utils.data.DataLoader`` arguments (``batch_sampler=BatchSamplerShard(...)``).

    Attributes:
        remainder: real samples in the last global batch of the epoch (-1 when unknown).

    Example:
        >>> from torch.utils.data import BatchSampler, SequentialSampler
        >>> shard = BatchSamplerShard(BatchSampler(SequentialSampler(range(6)), 2, False), 2, 1)
        >>> [batch.tolist() for batch in DataLoaderShard(range(6), batch_sampler=shard)]
        [[2, 3], [0, 1]]
    """

    def __init__(
        self,
        dataset: Any,
        device: torch.device | str | None = None,
        rng_types: list[Any] | None = None,
        synchronized_generator: torch.Generator | None = None,
        skip_batches: int = 0,
        _drop_last: bool = False,
        _non_blocking: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(dataset, **kwargs)
        self.device = device
        self.rng_types = list(rng_types) if rng_types is not None else None
        self.synchronized_generator = synchronized_generator
        self.skip_batches = skip_batches
        self._drop_last = _drop_last
        self._non_blocking = _non_blocking
        self._loader_kwargs = dict(kwargs)
        self._last_batch_length = -1
        shard = self._shard()
        if shard is not None:
            self._world = shard.num_processes
        else:
            self._world = dataset.num_processes if isinstance(dataset, IterableDatasetShard) else 1

    def _shard(self) -> BatchSamplerShard | None:
        for candidate in (self.batch_sampler, self.sampler):
            if isinstance(candidate, BatchSamplerShard):
                return candidate
        return None

    # -- hooks ------------------------------------------------------------------------------------
    def _order_sampler(self) -> Any:
        shard = self._shard()
        return getattr(self.batch_sampler if shard is None else shard, "sampler", None)

    def _replay_generator(self) -> torch.Generator | None:
        if self._seedable_sampler() is not None:
            return None  # its order follows from (seed, epoch)
        if self.synchronized_generator is not None:
            return self.synchronized_generator
        generator = getattr(self._order_sampler(), "generator", None)
        return generator if isinstance(generator, torch.Generator) else None

    def _synchronize(self) -> None:
        if self.rng_types:
            synchronize_rng_states(self.rng_types, self._replay_generator())
        seedable = self._seedable_sampler()
        if seedable is not None and not self._seed_synced:
            # The seed defaults to torch.initial_seed(), which differs across ranks without set_seed().
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                box = [seedable.initial_seed]
                dist.broadcast_object_list(box, src=0)
                seedable.initial_seed = box[0]
            self._seed_synced = True

    def _on_begin(self) -> None:
        self._last_batch_length = -1

    # -- iteration --------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        skip = self._begin_epoch()
        try:
            yield from self._track(self._batches(skip))
        finally:
            self._end_epoch()

    def _batches(self, skip: int) -> Iterator[Any]:
        shard = self._shard()
        if shard is not None:  # O(1): the sampler starts at the right batch
            shard.start_batch, skip = skip, 0
        for index, batch in enumerate(self._base_iterator()):
            if index < skip:
                continue
            if self.device is not None:
                batch = send_to_device(batch, self.device, non_blocking=self._non_blocking)
            yield batch

    def _base_iterator(self) -> Iterator[Any]:
        """torch's own iterator for this epoch.

        Creating it draws the epoch's base seed (for worker seeding) from the global generator, once per
        epoch. An epoch resumed from a checkpoint must not draw again: the checkpoint restored the global
        generator to its mid-epoch state, after that draw. So the draw is undone and the saved seed reused.
        """
        resuming, self._resume_mid_epoch = self._resume_mid_epoch, False
        global_state = torch.get_rng_state() if resuming and self.generator is None else None
        iterator = DataLoader.__iter__(self)
        if global_state is not None:
            torch.set_rng_state(global_state)
        if resuming and self._resume_base_seed is not None and hasattr(iterator, "_base_seed"):
            iterator._base_seed = self._resume_base_seed
        self._resume_base_seed = None
        self._epoch_base_seed = getattr(iterator, "_base_seed", None)
        return iterator

    def __len__(self) -> int:
        shard = self._shard()
        length = shard.epoch_length() if shard is not None else super().__len__()
        return max(0, length - self.skip_batches)

    # -- facts ------------------------------------------------------------------------------------
    @property
    def remainder(self) -> int:
        """Real samples in the last global batch of the epoch (-1 when unknown)."""
        shard = self._shard()
        if shard is not None and shard.remainder >= 0:
            return shard.remainder
        if isinstance(self.dataset, IterableDatasetShard):
            return self.dataset.remainder if self.num_workers == 0 else -1
        return self._last_batch_length if self._world == 1 else -1

    @property
    def total_batch_size(self) -> int | None:
        """Samples per step across all processes."""
        shard = self._shard()
        if shard is not None:
            return shard.spec.total_batch_size
        if isinstance(self.dataset, IterableDatasetShard):
            data = self.dataset
            return data.batch_size if data.split_batches else data.batch_size * data.num_processes
        return self.batch_size

    @property
    def total_dataset_length(self) -> int:
        """Samples in the whole dataset (all processes together)."""
        return getattr(self.dataset, "total_length", None) or len(self.dataset)  # type: ignore[arg-type]

    def _with_skip(self, num_batches: int) -> DataLoaderShard:
        """A copy that skips ``num_batches`` at the start of every epoch, sharing sampler and generator."""
        kwargs = dict(self._loader_kwargs)
        for key in ("batch_sampler", "sampler"):
            if isinstance(kwargs.get(key), BatchSamplerShard):
                kwargs[key] = copy.copy(kwargs[key])
        loader = DataLoaderShard(
            self.dataset,
            device=self.device,
            rng_types=self.rng_types,
            synchronized_generator=self.synchronized_generator,
            skip_batches=num_batches,
            _drop_last=self._drop_last,
            _non_blocking=self._non_blocking,
            **kwargs,
        )
        loader.iteration = self.iteration
        return loader
