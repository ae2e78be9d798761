"""The prepared loader of each process's share of the data: :class:`DataLoaderShard`.

It reads one batch ahead (``end_of_dataloader``), moves batches to the device and records its position;
the position and its state dict format are :mod:`lockstep.data._position`'s.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lockstep._nested import send_to_device
from lockstep.data._position import DataLoaderStateMixin, batch_length, replay_first_read
from lockstep.data.samplers import BatchSamplerShard, IterableDatasetShard
from lockstep.rng import synchronize_rng_states
from lockstep.step_hooks import StepHooks

__all__ = ["DataLoaderShard", "DataLoaderStateMixin", "batch_length"]


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
        use_stateful_dataloader: make the loader a torchdata ``StatefulDataLoader`` too (an instance of a
            subclass; see :mod:`lockstep.data._stateful`).
        step_hooks: the Accelerator's step hooks, run over the batches of every iteration.
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
        *,
        use_stateful_dataloader: bool = False,  # taken by __new__, which picks the class
        step_hooks: StepHooks | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(dataset, **kwargs)
        self.device = device
        self._step_hooks = step_hooks
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

    def _batches_per_step(self) -> int | None:
        shard = self._shard()
        if shard is None:
            return None
        return 1 if shard.split_batches else shard.num_processes

    def _sampler_batch_size(self) -> int | None:
        shard = self._shard()
        return None if shard is None else shard.batch_size

    def _epoch_samples(self) -> int | None:
        sampler = getattr(self._shard(), "sampler", None)
        return len(sampler) if hasattr(sampler, "__len__") else None  # type: ignore[arg-type]

    def _pads_last_step(self) -> bool | None:
        shard = self._shard()
        if shard is not None:
            return shard.even_batches and not shard.drop_last
        if isinstance(self.dataset, IterableDatasetShard):
            return not self.dataset.drop_last
        return False

    # -- iteration --------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        return self._epoch(self._batches)

    def _batches(self, skip: int) -> Iterator[Any]:
        shard = self._shard()
        in_stream, self._resume_in_stream = self._resume_in_stream, False
        if shard is not None:  # O(1): the sampler starts at the right batch
            shard.start_batch, shard.start_global, skip = skip, self._global_start, 0
        elif in_stream:  # the restored data source starts there by itself
            skip = 0
        replay = self._take_lookahead_replay()
        for batch in replay_first_read(self._base_iterator(), skip, replay):
            if self.device is not None:
                batch = send_to_device(batch, self.device, non_blocking=self._non_blocking)
            yield batch

    def _base_iterator(self) -> Iterator[Any]:
        """torch's own iterator for this epoch (a resumed epoch's keeps its saved seed: ``_seeded_iterator``)."""
        resuming, self._resume_mid_epoch = self._resume_mid_epoch, False
        return self._watch(self._seeded_iterator(self._open_iterator, resuming), 1)

    def _open_iterator(self) -> Iterator[Any]:
        """The iterator of the next class in the MRO: torch's ``DataLoader``, or torchdata's
        ``StatefulDataLoader`` for a stateful loader."""
        return super().__iter__()

    def __len__(self) -> int:
        shard = self._shard()
        if shard is not None:
            shard.start_global = self._global_offset()
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
        """A copy that skips ``num_batches`` at the start of every epoch, sharing the generator."""
        return self._continuing_copy(
            device=self.device,
            rng_types=self.rng_types,
            synchronized_generator=self.synchronized_generator,
            skip_batches=num_batches,
            _drop_last=self._drop_last,
            _non_blocking=self._non_blocking,
            step_hooks=self._step_hooks,
        )
