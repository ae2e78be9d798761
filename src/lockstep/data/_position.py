"""The resumable position of a prepared loader: end-of-epoch look-ahead, epoch and batches consumed.

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
        "epoch_seed": int,            # only mid-epoch, one process: the seed the epoch's sampler drew
        "generator_state": Tensor,    # only with a shuffling generator: its state at the epoch start
        "base_seed": int,             # only mid-epoch: the base seed of the epoch's workers
        "lookahead_rng": Tensor,      # only mid-epoch: torch's generator before the look-ahead batch
        ...                           # the position in global terms: see lockstep.data.resize
    }

The global terms (global batches of the epoch's order consumed, samples consumed) let a checkpoint resume on
another number of processes with every sample of the epoch read once (:mod:`lockstep.data.resize`); a
state without them (an older lockstep's) still loads, on any number of processes when its samples consumed
make whole batches of the original batch sampler.

The loader reads one batch ahead, so the batch after the last one yielded was already collated when a
checkpoint is taken, and a collate function that draws random numbers (``DataCollatorForLanguageModeling``
masks with torch's global generator) drew them before the step that the checkpoint follows.
``lookahead_rng`` is torch's global (CPU) generator as it was just before that batch was read; the resumed
epoch reads its first batch from there and then puts the generator back where ``load_state`` restored it,
so every batch and every later random number is the uninterrupted run's. Python's and NumPy's global
generators are not recorded per batch (reading their states costs 7 and 23 us, against 0.6 us for torch's
and about 30 us for the whole per-batch bookkeeping): a collate function that draws from them resumes with
the states ``save_state`` saved, as in Accelerate.

A loader prepared with ``use_stateful_dataloader=True`` adds torchdata's own state to this dict (see
:mod:`lockstep.data._stateful`).
"""

from __future__ import annotations

import contextlib
import copy
import random
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from lockstep._nested import find_batch_size
from lockstep.config.dataloader import require_torchdata
from lockstep.data.resize import Resize, resume_point
from lockstep.data.samplers import BatchSamplerShard, RecordingRandomSampler, SeedableRandomSampler
from lockstep.state import GradientState
from lockstep.step_hooks import StepHooks


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


def _lookahead(batches: Iterator[Any], before_read: Callable[[], None]) -> Iterator[tuple[Any, bool]]:
    """Each item with a flag that says whether it is the last one; ``before_read`` runs before each item
    after the first is read (while the one before it is still to be yielded)."""
    try:
        current = next(batches)
    except StopIteration:
        return
    while True:
        before_read()
        try:
            following = next(batches)
        except StopIteration:
            break
        yield current, False
        current = following
    yield current, True


_END = object()


def read_replayed(read: Callable[[], Any], before: torch.Tensor, restored: torch.Tensor) -> Any:
    """``read()`` with torch's global generator set to ``before``, which is then set to ``restored``."""
    torch.set_rng_state(before)
    try:
        return read()
    finally:
        torch.set_rng_state(restored)


def replay_first_read(iterator: Iterator[Any], skip: int, before: torch.Tensor | None) -> Iterator[Any]:
    """``iterator`` from item ``skip`` on. With ``before`` (a resumed epoch's ``lookahead_rng``), item
    ``skip`` is read with torch's global generator set to ``before``; then it is set back to what it was
    when reading started, so skipped and replayed reads draw nothing from the resumed run's stream."""
    restored = torch.get_rng_state() if before is not None else None
    for _ in range(skip):
        if next(iterator, _END) is _END:
            return
    if before is not None and restored is not None:
        first = read_replayed(lambda: next(iterator, _END), before, restored)
        if first is _END:
            return
        yield first
    yield from iterator


class ResumedWorkerSeeds:
    """The ``worker_init_fn`` of a resumed epoch: seeds each worker from the interrupted epoch's base seed.

    torch seeds worker ``k`` with ``base seed + k`` (Python's ``random``, torch, NumPy, and
    ``get_worker_info().seed``) from the seed its iterator drew when it started the workers, before lockstep
    can hand it the saved one. This runs first in each worker and seeds it as torch would have from
    ``base_seed``, then calls the user's ``worker_init_fn``. It is a plain class, so that workers started
    with ``spawn`` can unpickle it.

    Example:
        >>> ResumedWorkerSeeds(7, None).base_seed
        7
    """

    def __init__(self, base_seed: int, worker_init_fn: Callable[[int], None] | None) -> None:
        self.base_seed = base_seed
        self.worker_init_fn = worker_init_fn

    def __call__(self, worker_id: int) -> None:
        from torch.utils.data._utils import worker

        seed = self.base_seed + worker_id
        random.seed(seed)
        torch.manual_seed(seed)
        with contextlib.suppress(ImportError):
            import numpy

            numpy.random.seed(worker._generate_state(self.base_seed, worker_id))
        info = worker.get_worker_info()
        if info is not None:
            worker._worker_info = worker.WorkerInfo(
                id=worker_id, num_workers=info.num_workers, seed=seed, dataset=info.dataset
            )
        if self.worker_init_fn is not None:
            self.worker_init_fn(worker_id)


class DataLoaderStateMixin:
    """End-of-epoch flag, GradientState registration and the resumable position of a prepared loader.

    Constructing a loader with ``use_stateful_dataloader=True`` makes it an instance of a subclass that is
    also a torchdata ``StatefulDataLoader`` (:mod:`lockstep.data._stateful`), as in Accelerate.

    Attributes:
        end_of_dataloader: True while the last batch of the current epoch is processed.
        iteration: the epoch that the current (or next) iteration reads.
        skip_batches: batches skipped at the start of every epoch (see ``skip_first_batches``).
        use_stateful_dataloader: whether this loader is a torchdata ``StatefulDataLoader``.
    """

    use_stateful_dataloader: bool = False
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
    _lookahead_rng: torch.Tensor | None = None  # torch's generator before the look-ahead batch was read
    _epoch_generator: torch.Generator | None = None  # the shuffling generator of the current epoch
    _lookahead_order: torch.Tensor | None = None  # its state before the look-ahead batch was read
    _resume_lookahead_rng: torch.Tensor | None = None  # loaded, for the resumed epoch's first read
    _seed_synced: bool = False
    _step_hooks: StepHooks | None = None  # the Accelerator's (lockstep.step_hooks), given at construction
    # Set by a stateful loader's load_state_dict: the data source restores its own mid-epoch position, so the
    # next epoch reads no batches to discard them.
    _resume_in_stream: bool = False
    # skip_first_batches: the copy continues this loader (its position, its resume), and the loader knows the
    # copy that is reading its epoch, so that state_dict() and the next epoch stay right.
    _continues: Any = None
    _active_copy: Any = None
    _loader_kwargs: dict[str, Any]  # the DataLoader arguments the loader was built with
    # Global position (lockstep.data.resize): the epoch's global batches consumed before this attempt dealt
    # any (loaded, then of the running epoch), and for loaders without a batch sampler the samples.
    _pending_global: int = 0
    _global_start: int = 0
    _samples_before: int = 0
    _resume_stream: bool = False  # loaded: the data source resumes a resized epoch from its own state
    resized: Resize | None = None
    """Set by ``load_state_dict`` when the state was saved on another number of processes."""

    def __new__(cls, *args: Any, use_stateful_dataloader: bool = False, **kwargs: Any) -> Any:
        # Accelerate's loaders take the flag in their constructor: here it picks the stateful subclass.
        if use_stateful_dataloader and not cls.use_stateful_dataloader:
            require_torchdata(f"{cls.__name__}(use_stateful_dataloader=True)")
            from lockstep.data._stateful import stateful_variant  # imports torchdata, an optional dependency

            cls = stateful_variant(cls)
        return super().__new__(cls)

    def _continuing_copy(self, **settings: Any) -> Any:
        """A loader of this class over the same data, built with ``settings`` and this loader's DataLoader
        arguments, that continues this loader's epochs (``skip_first_batches``): its position, its resume and
        the next epoch. A shard sampler is copied, so that the copy's skip does not move this loader's."""
        kwargs = dict(self._loader_kwargs)
        for key in ("batch_sampler", "sampler"):
            if isinstance(kwargs.get(key), BatchSamplerShard):
                kwargs[key] = copy.copy(kwargs[key])
        loader = type(self)(self.dataset, **settings, **kwargs)  # type: ignore[attr-defined]
        loader.iteration = self.iteration
        loader._continues = self
        return loader

    # -- hooks ------------------------------------------------------------------------------------
    def _shard(self) -> BatchSamplerShard | None:
        """The sampler that deals this process's batches, when the data is map-style (it skips in O(1))."""
        return None

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

    def _batches_per_step(self) -> int | None:
        """Global batches of the original batch sampler that one step of every process consumes (None when
        the loader does not deal an original batch sampler's batches)."""
        return None

    def _sampler_batch_size(self) -> int | None:
        """The original batch sampler's batch size (None when unknown)."""
        return None

    def _epoch_samples(self) -> int | None:
        """Samples in the epoch of the original sampler (None when unknown)."""
        return None

    def _pads_last_step(self) -> bool | None:
        """Whether a short last step of an epoch is completed with samples from the epoch's start
        (``even_batches``, an iterable dataset's last buffer); None when unknown."""
        return None

    def _restores_own_stream(self, state_dict: Mapping[str, Any]) -> bool:
        """Whether the data source restores its own position from ``state_dict`` (a stateful dataset)."""
        return False

    def _global_offset(self) -> int:
        """Global batches of the current (or next) epoch consumed before this attempt."""
        return self._global_start if self._in_epoch else self._pending_global

    def _watch(self, iterator: Iterator[Any], every: int) -> Iterator[Any]:
        """torch's iterator of the epoch, as this loader reads it; ``every`` items make one step.

        A stateful loader records the iterator's state at each step boundary here.
        """
        return iterator

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

    def _adopt_resume(self) -> None:
        """A ``skip_first_batches`` copy takes over what ``load_state`` restored on the loader it continues:
        the epoch, the replay of its order and random numbers; its own skip replaces the restored position,
        so nothing is skipped twice."""
        parent = self._continues
        restored = parent._pending_skip
        self.iteration = parent.iteration
        self._seed_synced = parent._seed_synced
        if restored is not None or parent._resume_mid_epoch:
            self._resume_mid_epoch, self._resume_base_seed = (
                parent._resume_mid_epoch,
                parent._resume_base_seed,
            )
            # The generator saved before the restored position's batch fits that batch only.
            lookahead = parent._resume_lookahead_rng
            self._resume_lookahead_rng = lookahead if restored == self.skip_batches else None
            parent._pending_skip, parent._resume_mid_epoch, parent._resume_base_seed = None, False, None
            resized = parent._pending_global or parent._samples_before
            if resized and self.skip_batches != restored:
                warnings.warn(
                    f"skip_first_batches(..., {self.skip_batches}) after load_state, which restored the loader "
                    "where a run on another number of processes stopped: the epoch starts at batch "
                    f"{self.skip_batches} of this process as asked, not there (pass 0 to continue exactly where "
                    "the checkpoint stopped).",
                    stacklevel=4,
                )
            elif resized:
                self._pending_global, self._samples_before = parent._pending_global, parent._samples_before
            parent._pending_global, parent._samples_before = 0, 0
            parent._resume_lookahead_rng = None
            if restored and restored != self.skip_batches:
                warnings.warn(
                    f"skip_first_batches(..., {self.skip_batches}) after load_state, which restored the loader "
                    f"at batch {restored} of epoch {self.iteration}: the epoch starts at batch "
                    f"{self.skip_batches} as asked (pass {restored} to continue where the checkpoint stopped).",
                    stacklevel=4,
                )
        parent._active_copy = self

    def _epoch(self, batches: Callable[[int], Iterator[Any]]) -> Iterator[Any]:
        """One epoch of ``batches(skip)`` (this process's batches after the ``skip`` first), tracked between
        :meth:`_begin_epoch` and :meth:`_end_epoch` (which runs when the epoch is broken off too)."""
        skip = self._begin_epoch()
        try:
            yield from self._track(batches(skip))
        finally:
            self._end_epoch()

    def _seeded_iterator(self, open_iterator: Callable[[], Iterator[Any]], resuming: bool) -> Iterator[Any]:
        """torch's own iterator for this epoch, from ``open_iterator``.

        Creating it draws the epoch's base seed (for worker seeding) from the global generator, once per
        epoch. An epoch resumed from a checkpoint (``resuming``) must not draw again: the checkpoint restored
        the global generator to its mid-epoch state, after that draw. So the draw is undone and the saved seed
        reused: its workers are seeded from it (:class:`ResumedWorkerSeeds`, since torch hands the drawn seed
        to the workers as it starts them), and the iterator records it for the next checkpoint.
        """
        global_state = torch.get_rng_state() if resuming and self.generator is None else None
        saved_seed = self._resume_base_seed if resuming else None
        user_init = self.worker_init_fn
        if saved_seed is not None and self.num_workers > 0:
            self.worker_init_fn = ResumedWorkerSeeds(saved_seed, user_init)
        try:
            iterator = open_iterator()
        finally:
            self.worker_init_fn = user_init
        if global_state is not None:
            torch.set_rng_state(global_state)
        if saved_seed is not None and hasattr(iterator, "_base_seed"):
            iterator._base_seed = saved_seed
        self._resume_base_seed = None
        self._epoch_base_seed = getattr(iterator, "_base_seed", None)
        return iterator

    def _begin_epoch(self) -> int:
        """Start an iteration; returns how many of this process's batches to skip."""
        if self._continues is not None:
            self._adopt_resume()
        self.end_of_dataloader = False
        skip = self.skip_batches if self._pending_skip is None else self._pending_skip
        self._pending_skip = None
        self._global_start, self._pending_global = self._pending_global, 0
        self._on_begin()
        self._forward_epoch(self.iteration)
        self._synchronize()
        generator = self._replay_generator()
        self._epoch_start_state = None if generator is None else generator.get_state()
        self._epoch_generator, self._lookahead_order = generator, None
        self._batches_yielded = skip
        self._in_epoch = True
        self.gradient_state._add_dataloader(self)
        return skip

    def _track(self, batches: Iterator[Any]) -> Iterator[Any]:
        """Yield ``batches`` one ahead, keeping ``end_of_dataloader`` and the position up to date."""
        tracked = self._track_position(batches)
        hooks = self._step_hooks
        return tracked if hooks is None else hooks.batches(tracked)

    def _take_lookahead_replay(self) -> torch.Tensor | None:
        """The generator state to read a resumed epoch's first batch with (once; None when not resuming)."""
        replay, self._resume_lookahead_rng = self._resume_lookahead_rng, None
        return replay

    def _record_lookahead_rng(self) -> None:
        self._lookahead_rng = torch.get_rng_state()
        if self._epoch_generator is not None:
            self._lookahead_order = self._epoch_generator.get_state()

    def _track_position(self, batches: Iterator[Any]) -> Iterator[Any]:
        self._lookahead_rng = None
        for batch, is_last in _lookahead(batches, self._record_lookahead_rng):
            self.end_of_dataloader = is_last
            if is_last:
                self._last_batch_length = batch_length(batch)
            self._batches_yielded += 1
            yield batch
        self.iteration += 1
        self._batches_yielded = 0
        self._in_epoch = False
        self._global_start = self._samples_before = 0
        if self._continues is not None:
            self._continues.iteration = self.iteration  # the loader continues with the next epoch

    def _end_epoch(self) -> None:
        if self._in_epoch and self._lookahead_order is not None and self._epoch_generator is not None:
            # Broken off (an early-stopping break): the batch read ahead was never taken, so the shuffling
            # generator goes back to where plain PyTorch, which reads no batch ahead, leaves it. The next
            # epoch's order is then plain PyTorch's.
            self._epoch_generator.set_state(self._lookahead_order)
        self._lookahead_order = None
        self.gradient_state._remove_dataloader(self)
        if self._continues is not None and self._continues._active_copy is self:
            self._continues._active_copy = None

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
        copy = self._active_copy
        if copy is not None and copy._in_epoch:  # a skip_first_batches copy is reading this loader's epoch
            return copy.state_dict()
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
        finished = self._in_epoch and self.end_of_dataloader
        result.update(self._global_keys(0 if finished else position, finished))
        mid = position > 0 or result.get("global_start", 0) > 0 or result.get("samples_before", 0) > 0
        if state is not None:
            result["generator_state"] = state.clone()
        base_seed = (
            self._epoch_base_seed if self._in_epoch else self._resume_base_seed
        )  # loaded, not yet read
        if mid and base_seed is not None:
            result["base_seed"] = int(base_seed)
        lookahead = self._lookahead_rng if self._in_epoch else self._resume_lookahead_rng
        if mid and lookahead is not None and not finished:
            result["lookahead_rng"] = lookahead.clone()
        recording = self._order_sampler()
        if mid and isinstance(recording, RecordingRandomSampler):
            result.update(_recorded_order(recording, self._in_epoch))
        return result

    def _global_keys(self, position: int, finished: bool) -> dict[str, int]:
        """The position in global terms (:mod:`lockstep.data.resize`); ``position``: this process's
        batches of the epoch consumed."""
        if finished:
            return {"global_start": 0, "global_batches": 0, "samples_consumed": 0}
        per_step, size = self._batches_per_step(), self._sampler_batch_size()
        if per_step is None:
            before = self._samples_before
            samples = before + position * int(self.total_batch_size or 0)
            return {"samples_before": int(before), "samples_consumed": int(samples)}
        start = self._global_offset()
        consumed = start + position * per_step
        samples = consumed * (size or 0)
        epoch_samples = self._epoch_samples()
        return {
            "global_start": int(start),
            "global_batches": int(consumed),
            "sampler_batch_size": int(size or -1),
            "samples_consumed": int(samples if epoch_samples is None else min(samples, epoch_samples)),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume where ``state_dict`` was taken: the next iteration starts at the next unseen batch, also
        on another number of processes (:mod:`lockstep.data.resize`; ``resized`` then tells how)."""
        missing = [key for key in ("epoch", "batches_yielded") if key not in state_dict]
        if missing:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict() got a dict without {missing} (keys: "
                f"{sorted(state_dict)}); pass a dict returned by a prepared loader's state_dict()."
            )
        point = resume_point(
            state_dict,
            world=int(getattr(self, "_world", 1)),
            total=self.total_batch_size,
            batch_size=self._sampler_batch_size(),
            deals_global=self._batches_per_step() is not None,
            own_stream=self._restores_own_stream(state_dict),
        )
        position, self.resized = point.skip, point.resize
        self._pending_global, self._samples_before, self._resume_stream = (
            point.global_start,
            point.samples_before,
            point.in_stream,
        )
        self.iteration = int(state_dict["epoch"])
        self._pending_skip = position
        mid_epoch = position > 0 or point.global_start > 0 or point.samples_before > 0
        self._resume_mid_epoch = mid_epoch
        self._resume_base_seed = (
            int(state_dict["base_seed"]) if mid_epoch and "base_seed" in state_dict else None
        )
        lookahead = state_dict.get("lookahead_rng")
        same_batch = point.resize is None and position == int(state_dict["batches_yielded"])
        self._resume_lookahead_rng = (
            lookahead.clone() if position > 0 and same_batch and isinstance(lookahead, torch.Tensor) else None
        )
        self._in_epoch = False
        self.end_of_dataloader = False
        self._restore_order(state_dict)

    def _restore_order(self, state_dict: Mapping[str, Any]) -> None:
        """The sampler seed, the shuffling generator at the epoch start and a recorded epoch seed."""
        seedable, seed = self._seedable_sampler(), int(state_dict.get("sampler_seed", -1))
        if seedable is not None and seed >= 0:
            seedable.initial_seed = seed
            self._seed_synced = True
        generator, state = self._replay_generator(), state_dict.get("generator_state")
        epoch_seed = state_dict.get("epoch_seed")
        if generator is not None and state is not None:
            generator.set_state(state)
        elif generator is not None and epoch_seed is not None:  # an epoch one process began: its seed
            generator.manual_seed(int(epoch_seed))
        recording = self._order_sampler()
        if isinstance(recording, RecordingRandomSampler):  # one process: the epoch's seed, or (saved on
            # several processes, which shuffle with a generator of their own) that generator's state
            recording.replay_seed = None if epoch_seed is None else int(epoch_seed)
            replays_state = epoch_seed is None and state is not None and self._resume_mid_epoch
            recording.replay_state = state.clone() if replays_state else None


def _recorded_order(recording: RecordingRandomSampler, in_epoch: bool) -> dict[str, Any]:
    """What replays the order of a one-process epoch: its seed, or the generator state it replayed."""
    seed = recording.epoch_seed if in_epoch else recording.replay_seed
    if seed is not None:
        return {"epoch_seed": int(seed)}
    state = recording.epoch_state if in_epoch else recording.replay_state
    return {} if state is None else {"generator_state": state.clone()}
