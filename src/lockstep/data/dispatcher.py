"""A dataloader that reads on rank 0 only and sends every process its part of each batch.

Rank 0 iterates the original loader, concatenates ``N`` of its batches (one when splitting) into a
global batch and broadcasts it: first its structure (with every non-tensor leaf, such as a list of
strings) through ``broadcast_object_list``, then each tensor through ``broadcast``. Every rank then
slices its contiguous part. This is how iterable datasets are prepared by default: the stream is read
once, in one order, whatever the number of processes.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lockstep._nested import concatenate_batches, leaves, recursively_apply, send_to_device, slice_batch
from lockstep.data._position import read_replayed
from lockstep.data.loader import DataLoaderStateMixin, batch_length
from lockstep.data.samplers import BatchSamplerShard
from lockstep.state import PartialState
from lockstep.step_hooks import StepHooks

_COLLECTIVE_BACKENDS = ("nccl", "xccl", "hccl")


@dataclass(frozen=True)
class _TensorSlot:
    """Stands for a tensor in the structure sent ahead of the tensors themselves."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _describe(batch: Any) -> Any:
    return recursively_apply(lambda t: _TensorSlot(tuple(t.shape), t.dtype), batch)


def _materialize(structure: Any, device: torch.device) -> Any:
    return recursively_apply(
        lambda slot: torch.empty(slot.shape, dtype=slot.dtype, device=device),
        structure,
        test_type=lambda leaf: isinstance(leaf, _TensorSlot),
    )


def _pad(batch: Any, first: Any, size: int) -> Any:
    """``batch`` completed to ``size`` samples with samples of ``first``, cycled from its start."""
    missing = size - batch_length(batch)
    repeats = -(-missing // batch_length(first))
    filler = slice_batch(concatenate_batches([first] * repeats), slice(0, missing))
    return concatenate_batches([batch, filler])


class DataLoaderDispatcher(DataLoader, DataLoaderStateMixin):
    """Reads batches on rank 0 only and gives each process its slice of every global batch.

    Build it with :func:`~lockstep.data.prepare_data_loader` (``dispatch_batches=True``, the default for
    iterable datasets).

    Args:
        dataset: the dataset, read on rank 0 only.
        split_batches: each batch of the original loader is the global batch (else ``N`` batches are
            concatenated into one).
        skip_batches: skip this many of this process's batches at the start of every epoch.
        use_stateful_dataloader: make the loader a torchdata ``StatefulDataLoader`` too (an instance of a
            subclass; see :mod:`lockstep.data._stateful`).
        even_batches: complete a short last global batch with samples of the first global batch, so that
            every process gets a full batch; without it a process gets what is left, or nothing.
        device: move each batch there (None: leave it on the device it was broadcast on).
        step_hooks: the Accelerator's step hooks, run over the batches of every iteration.
        **kwargs: the ``torch.utils.data.DataLoader`` arguments.

    Attributes:
        remainder: real samples in the last global batch of the epoch (-1 before it is read).
    """

    # The epoch's first global batch (padding of a short last one), kept for the state of a stateful loader,
    # and the one restored with a mid-epoch state whose data source resumes by itself.
    _first_batch: Any = None
    _restored_first: Any = None

    def __init__(
        self,
        dataset: Any,
        split_batches: bool = False,
        skip_batches: int = 0,
        _drop_last: bool = False,
        _non_blocking: bool = False,
        *,
        use_stateful_dataloader: bool = False,  # taken by __new__, which picks the class
        even_batches: bool = True,
        device: torch.device | str | None = None,
        step_hooks: StepHooks | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(dataset, **kwargs)
        self._step_hooks = step_hooks
        state = PartialState()
        self.split_batches = split_batches
        self.skip_batches = skip_batches
        self.even_batches = even_batches
        self.device = device
        self.remainder = -1
        self._drop_last = _drop_last
        self._non_blocking = _non_blocking
        self._loader_kwargs = dict(kwargs)
        self._world, self._rank = state.num_processes, state.process_index
        use_device = state.backend in _COLLECTIVE_BACKENDS
        self._comm_device = state.device if use_device else torch.device("cpu")
        size = self._declared_batch_size()
        if split_batches and size is not None and size % self._world != 0:
            raise ValueError(
                f"split_batches=True needs the batch size ({size}) to be a round multiple of the number of "
                f"processes ({self._world}). Change the batch size, or pass split_batches=False."
            )

    def _shard(self) -> BatchSamplerShard | None:
        for candidate in (self.batch_sampler, self.sampler):
            if isinstance(candidate, BatchSamplerShard):
                return candidate
        return None

    def _declared_batch_size(self) -> int | None:
        if self.batch_size is not None:
            return self.batch_size
        return getattr(self._shard(), "batch_size", None)

    # -- hooks ------------------------------------------------------------------------------------
    def _order_sampler(self) -> Any:
        shard = self._shard()
        return None if shard is None else shard.sampler

    def _replay_generator(self) -> torch.Generator | None:
        if self._seedable_sampler() is not None:
            return None
        generator = getattr(self._order_sampler(), "generator", None)
        if generator is None:
            generator = getattr(self.dataset, "generator", None)
        return generator if isinstance(generator, torch.Generator) else None

    def _on_begin(self) -> None:
        self.remainder = -1

    def _pads_last_step(self) -> bool | None:
        return self.even_batches and self._world > 1 and not self._drop_last

    # -- rank 0: reading the original loader --------------------------------------------------------
    def _global_batches(self, skip: int, resuming: bool) -> Iterator[tuple[Any, int, int]]:
        """On rank 0: (global batch, real samples, samples per process) for each step after ``skip``
        (``resuming``: the epoch continues a checkpoint, as the sharded loader's ``_base_iterator``)."""
        group = 1 if self.split_batches else self._world
        shard = self._shard()
        restored_first, self._restored_first = self._restored_first, None
        in_stream, self._resume_in_stream = self._resume_in_stream, False
        first: Any = None
        if shard is not None:  # O(1) skip in the sampler; the first batches are re-read if padding needs them
            shard.start_batch, skip = skip * group, 0
        elif in_stream:  # the restored data source starts there by itself; its first batch came with it
            skip, first = 0, restored_first
        raw = self._watch(self._seeded_iterator(super().__iter__, resuming), group)
        replay = self._take_lookahead_replay()  # the generator to read the resumed epoch's first step with
        restored = torch.get_rng_state() if replay is not None else None
        for step in itertools.count():
            if replay is not None and restored is not None and step == skip:
                batches = read_replayed(lambda: list(itertools.islice(raw, group)), replay, restored)
            else:
                batches = list(itertools.islice(raw, group))
            if not batches:
                return
            batch = batches[0] if group == 1 else self._concatenate(batches)
            if first is None and (shard is None or shard.start_batch == 0):
                first = batch
            self._first_batch = first
            if step < skip:
                continue
            real = batch_length(batch)
            full = self.total_batch_size or batch_length(first if first is not None else batch)
            if real < full:
                if self._drop_last:
                    continue
                if self.even_batches and self._world > 1:
                    first = first if first is not None else self._read_first(shard, group)
                    batch = _pad(batch, first, full)
            yield batch, real, self._per_process(full)

    def _per_process(self, full: int) -> int:
        if full % self._world != 0:
            raise ValueError(
                f"DataLoaderDispatcher on rank {self._rank} of {self._world}: a global batch of {full} samples "
                f"cannot be cut into {self._world} equal parts. Use a batch size that is a multiple of it."
            )
        return full // self._world

    @staticmethod
    def _concatenate(batches: list[Any]) -> Any:
        try:
            return concatenate_batches(batches)
        except (RuntimeError, TypeError) as error:
            raise RuntimeError(
                "dispatch_batches=True concatenates the batches of the original loader, and these cannot be "
                f"concatenated ({error}). Make them the same shape (pad in the collate function), pass "
                "split_batches=True so that each batch is split instead, or dispatch_batches=False."
            ) from error

    def _read_first(self, shard: BatchSamplerShard | None, group: int) -> Any:
        """Re-read the first global batch of the epoch after an O(1) skip (map-style data only)."""
        assert shard is not None and shard.current_plan is not None
        plan = shard.current_plan
        batches = [self._fetch(plan[i]) for i in range(min(group, len(plan)))]
        return batches[0] if len(batches) == 1 else self._concatenate(batches)

    def _fetch(self, indices: list[int]) -> Any:
        if hasattr(self.dataset, "__getitems__"):
            samples = self.dataset.__getitems__(indices)
        else:
            samples = [self.dataset[i] for i in indices]
        if self._auto_collation:
            return self.collate_fn(samples)
        return self.collate_fn(self.dataset[indices])

    # -- every rank: receiving ----------------------------------------------------------------------
    def _next_message(
        self, source: Iterator[tuple[Any, int, int]] | None
    ) -> tuple[list[Any], Any, Exception | None]:
        if source is None:
            return [None, None, 0, 0], None, None
        try:
            batch, real, per_process = next(source)
        except StopIteration:
            return ["stop", None, 0, 0], None, None
        except Exception as error:
            return ["error", f"{type(error).__name__}: {error}", 0, 0], None, error
        local = recursively_apply(lambda t: t.to(self._comm_device).contiguous(), batch)
        return ["batch", _describe(local), real, per_process], local, None

    def _received(self, skip: int) -> Iterator[tuple[Any, int, int]]:
        """On every rank: (global batch, real samples, samples per process), as rank 0 sends them."""
        resuming, self._resume_mid_epoch = self._resume_mid_epoch, False
        source = self._global_batches(skip, resuming) if self._rank == 0 else None
        if source is None:
            self._take_lookahead_replay()  # only rank 0 reads (and collates) batches
            self._resume_base_seed = None
            # Creating a DataLoader iterator draws a base seed from ``generator`` (the global one by
            # default); draw it here too so that the ranks' random streams stay aligned (a resumed epoch
            # does not draw it again on rank 0 either).
            if not resuming:
                torch.empty((), dtype=torch.int64).random_(generator=self.generator)
        while True:
            message, local, error = self._next_message(source)
            if self._world > 1:
                dist.broadcast_object_list(message, src=0)
            kind = message[0]
            if kind == "stop":
                return
            if kind == "error":
                if error is not None:
                    raise error
                raise RuntimeError(
                    f"DataLoaderDispatcher on rank {self._rank} of {self._world}: rank 0 failed to read the "
                    f"next batch ({message[1]}); see rank 0's traceback."
                )
            batch = local if self._rank == 0 else _materialize(message[1], self._comm_device)
            if self._world > 1:
                for tensor in leaves(batch):
                    dist.broadcast(tensor, src=0)
            yield batch, message[2], message[3]

    def _my_batches(self, skip: int) -> Iterator[Any]:
        for batch, real, per_process in self._received(skip):
            self.remainder = real
            start = self._rank * per_process
            stop = min(start + per_process, batch_length(batch))
            if stop <= start:
                continue
            piece = slice_batch(batch, slice(start, stop))
            if self.device is not None:
                piece = send_to_device(piece, self.device, non_blocking=self._non_blocking)
            yield piece

    def __iter__(self) -> Iterator[Any]:
        return self._epoch(self._my_batches)

    def __len__(self) -> int:
        shard = self._shard()
        whole = shard.epoch_length() if shard is not None else super().__len__()
        if self.split_batches:
            length = whole
        elif self._drop_last:
            length = whole // self._world
        else:
            length = -(-whole // self._world)
        return max(0, length - self.skip_batches)

    # -- facts ------------------------------------------------------------------------------------
    @property
    def total_batch_size(self) -> int | None:
        """Samples per step across all processes."""
        size = self._declared_batch_size()
        if size is None:
            return None
        return size if self.split_batches else size * self._world

    @property
    def total_dataset_length(self) -> int:
        """Samples in the whole dataset."""
        return len(self.dataset)  # type: ignore[arg-type]

    def _with_skip(self, num_batches: int) -> DataLoaderDispatcher:
        """A copy that skips ``num_batches`` at the start of every epoch."""
        return self._continuing_copy(
            split_batches=self.split_batches,
            skip_batches=num_batches,
            _drop_last=self._drop_last,
            _non_blocking=self._non_blocking,
            even_batches=self.even_batches,
            device=self.device,
            step_hooks=self._step_hooks,
        )
