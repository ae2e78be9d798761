"""Prepared loaders that are torchdata ``StatefulDataLoader``s too (``use_stateful_dataloader=True``).

``prepare_data_loader(..., use_stateful_dataloader=True)``, ``DataLoaderConfiguration(use_stateful_dataloader=
True)`` for the Accelerator, and ``DataLoaderShard(..., use_stateful_dataloader=True)`` give the classes
below: the same prepared loaders, built on torchdata's ``StatefulDataLoader`` instead of torch's
``DataLoader``. The MRO is ``StatefulDataLoaderShard -> _StatefulLoader -> DataLoaderShard ->
StatefulDataLoader -> DataLoader -> DataLoaderStateMixin``, so sharding, ``even_batches``, the look-ahead,
device placement, ``remainder``, ``skip_first_batches`` and ``set_epoch`` are the prepared loader's, torch's
iterator of each epoch is torchdata's, and ``isinstance(loader, StatefulDataLoader)`` holds.

What the state holds
--------------------
lockstep's own position stays the authority (:mod:`lockstep.data._position`: epoch, batches consumed, sampler
seed, generator state; exact, the same on every rank, O(1) to restore for map-style data). In the middle of
an epoch the state adds::

    "stateful_dataloader": dict,  # torchdata's state of this process's iterator after the consumed batches
    "first_batch": Any,           # dispatcher over a stream only: the epoch's first global batch (padding)

torchdata's part is taken before the iterator reads each step, so the batch read ahead is not in it. It
holds what lockstep cannot rebuild: the state of a dataset that has ``state_dict``/``load_state_dict`` (of
each worker's copy, with ``num_workers > 0``), the workers' round robin and base seed. Loading it:

* map-style data (read through a ``BatchSamplerShard``): lockstep's sampler starts at the saved batch in
  O(1), and torchdata's sampler count is set to 0 so that it does not skip those batches a second time;
  the datasets' states are restored.
* iterable data (and map-style data without a batch sampler): torchdata positions the stream. A dataset
  with a state of its own resumes from it, also through :class:`~lockstep.data.IterableDatasetShard`,
  which passes the state on and keeps the epoch's first round to pad the last one; any other dataset is
  read again up to the saved batch, once (by torchdata, or by the shard).

At an epoch boundary (before the first batch, after the last) the state has no torchdata part: a finished
torchdata iterator starts afresh too. The torchdata part is the saving process's: ``Accelerator.save_state``
writes the main process's loader state (``dataloader_N.bin``) and every rank loads it. That is exact for
streams (each rank reads the whole stream through the shard; the dispatcher reads on rank 0 only) and for
map-style datasets whose state does not depend on the rank; a dataset whose state does gets rank 0's.
A state saved with another ``num_workers`` does not fit torchdata's iterator: its torchdata part is left out
with a warning, and lockstep's position alone resumes.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

from lockstep.config.dataloader import require_torchdata
from lockstep.data._position import DataLoaderStateMixin
from lockstep.data.dispatcher import DataLoaderDispatcher
from lockstep.data.loader import DataLoaderShard
from lockstep.data.samplers import IterableDatasetShard

StatefulDataLoader = require_torchdata("use_stateful_dataloader=True")

STATE_KEY = "stateful_dataloader"
FIRST_BATCH_KEY = "first_batch"
# torchdata 0.11's keys: a multi-worker state nests the main process's part; its sampler count is a batch count.
_SNAPSHOT, _MAIN_SNAPSHOT, _NUM_WORKERS = "_snapshot", "_main_snapshot", "_num_workers"
_SAMPLER_YIELDED = "_sampler_iter_yielded"


def _saved_workers(state: Mapping[str, Any]) -> int:
    """The ``num_workers`` of the loader that produced torchdata's ``state``."""
    return int(state[_SNAPSHOT][_MAIN_SNAPSHOT][_NUM_WORKERS]) if _SNAPSHOT in state else 0


def _without_sampler_progress(state: Mapping[str, Any]) -> dict[str, Any]:
    """torchdata's ``state`` with its sampler at the epoch start: lockstep's sampler skips those batches."""
    copied = copy.deepcopy(dict(state))
    main = copied[_SNAPSHOT][_MAIN_SNAPSHOT] if _SNAPSHOT in copied else copied
    main[_SAMPLER_YIELDED] = 0
    return copied


class _StatefulLoader(DataLoaderStateMixin):
    """What makes a prepared loader stateful; first in the MRO, before the prepared loader's class."""

    use_stateful_dataloader = True
    _snapshot: dict[str, Any] | None = None  # torchdata's state after the batches consumed this epoch
    _loaded: dict[str, Any] | None = None  # torchdata's state loaded for the next epoch, not yet read

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with warnings.catch_warnings():
            # torchdata 0.11's StatefulDataLoader.__init__ calls torch.set_vital, which torch 2.13 deprecates.
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
            super().__init__(*args, **kwargs)

    def _on_begin(self) -> None:
        super()._on_begin()
        self._snapshot = self._loaded = None

    def _watch(self, iterator: Iterator[Any], every: int) -> Iterator[Any]:
        """The items of torchdata's ``iterator``, with its state recorded before each step."""
        for index in itertools.count():
            if index % every == 0:
                # A copy: a dataset's state_dict() may hand out objects that it changes while reading on.
                self._snapshot = copy.deepcopy(iterator.state_dict())
            try:
                item = next(iterator)
            except StopIteration:
                return
            yield item

    def _restores_own_stream(self, state_dict: Mapping[str, Any]) -> bool:
        """A stream whose dataset saves its own position (also through an ``IterableDatasetShard``)."""
        if self._shard() is not None or state_dict.get(STATE_KEY) is None:
            return False
        dataset = self.dataset  # type: ignore[attr-defined]
        dataset = dataset.dataset if isinstance(dataset, IterableDatasetShard) else dataset
        return callable(getattr(dataset, "state_dict", None)) and callable(
            getattr(dataset, "load_state_dict", None)
        )

    def _extra_state(self, pending: bool) -> dict[str, Any]:
        """What else a mid-epoch state needs (``pending``: the loaded state, not yet read)."""
        return {}

    def _load_extra_state(self, state_dict: Mapping[str, Any]) -> None:
        """Take what :meth:`_extra_state` added."""

    def state_dict(self) -> dict[str, Any]:
        """lockstep's position, and mid-epoch torchdata's state of this process (module docstring)."""
        # Explicitly the mixin's: StatefulDataLoader.state_dict comes before it in the MRO.
        state = DataLoaderStateMixin.state_dict(self)
        if state["batches_yielded"] > 0:
            pending = not self._in_epoch
            inner = self._loaded if pending else self._snapshot
            if inner is not None:
                state[STATE_KEY] = copy.deepcopy(inner)
                state.update(self._extra_state(pending))
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume where ``state_dict`` was taken: lockstep's position, and torchdata's state when it fits."""
        DataLoaderStateMixin.load_state_dict(self, state_dict)
        StatefulDataLoader.load_state_dict(self, {})  # drops the iterator
        self.next_iter_state = None  # and a state loaded before
        self._loaded, self._resume_in_stream = None, False
        inner, position = state_dict.get(STATE_KEY), self._pending_skip or 0
        same = self.resized is None and 0 < position == int(state_dict["batches_yielded"])
        if inner is None or not (same or self._resume_stream):
            return  # at an epoch boundary, or rescaled to another batch size: lockstep's position alone
        workers = self.num_workers  # type: ignore[attr-defined]
        if _saved_workers(inner) != workers:
            warnings.warn(
                f"The dataloader state was saved with num_workers={_saved_workers(inner)} and this loader has "
                f"num_workers={workers}: torchdata's part of it (the datasets' own states, the workers') is left "
                "out. The loader still resumes at the next unseen batch, with datasets in their initial state (a "
                "stream is read again up to there). Resume with the same num_workers to keep it.",
                stacklevel=2,
            )
            return
        if self._shard() is None or self._resume_stream:
            self._resume_in_stream = True
            dataset = self.dataset  # type: ignore[attr-defined]
            StatefulDataLoader.load_state_dict(self, _fit_dataset_states(copy.deepcopy(dict(inner)), dataset))
        else:
            StatefulDataLoader.load_state_dict(self, _without_sampler_progress(inner))
        self._loaded = copy.deepcopy(dict(inner))
        self._load_extra_state(state_dict)


_SHARD_STATE_KEYS = frozenset({"rounds", "dataset", "first_round"})


def _fit_dataset_states(inner: dict[str, Any], dataset: Any) -> dict[str, Any]:
    """torchdata's state ``inner`` with each dataset state in the form ``dataset`` loads: a stream saved on
    one process (the user's dataset itself) resumed on several (wrapped in an ``IterableDatasetShard``, which
    then deals from the stream's own position), or the other way round."""

    def fit(state: Any) -> Any:
        wrapped = isinstance(state, Mapping) and _SHARD_STATE_KEYS <= set(state)
        if isinstance(dataset, IterableDatasetShard) and state is not None and not wrapped:
            return {"rounds": 0, "dataset": state, "first_round": None}
        if not isinstance(dataset, IterableDatasetShard) and wrapped:
            return state["dataset"]
        return state

    def walk(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        return {key: fit(value) if key == "dataset_state" else walk(value) for key, value in node.items()}

    return walk(inner)


class _StatefulDispatcher(_StatefulLoader):
    """A dispatcher over a stream also keeps the epoch's first global batch, which pads a short last one."""

    def _extra_state(self, pending: bool) -> dict[str, Any]:
        first = self._restored_first if pending else self._first_batch  # type: ignore[attr-defined]
        if first is None or self._shard() is not None:
            return {}  # a sampler re-reads it
        return {FIRST_BATCH_KEY: copy.deepcopy(first)}

    def _load_extra_state(self, state_dict: Mapping[str, Any]) -> None:
        self._restored_first = copy.deepcopy(state_dict.get(FIRST_BATCH_KEY))


class StatefulDataLoaderShard(_StatefulLoader, DataLoaderShard, StatefulDataLoader):
    """A :class:`~lockstep.data.DataLoaderShard` that is a torchdata ``StatefulDataLoader``.

    ``DataLoaderShard(..., use_stateful_dataloader=True)`` constructs one.
    """


class StatefulDataLoaderDispatcher(_StatefulDispatcher, DataLoaderDispatcher, StatefulDataLoader):
    """A :class:`~lockstep.data.DataLoaderDispatcher` that is a torchdata ``StatefulDataLoader``."""


_VARIANTS: dict[type, type] = {
    DataLoaderShard: StatefulDataLoaderShard,
    DataLoaderDispatcher: StatefulDataLoaderDispatcher,
}


def stateful_variant(cls: type) -> type:
    """The subclass of the prepared loader class ``cls`` that is also a ``StatefulDataLoader``."""
    if cls not in _VARIANTS:  # a user's subclass
        mixin = _StatefulDispatcher if issubclass(cls, DataLoaderDispatcher) else _StatefulLoader
        bases = (mixin, cls, StatefulDataLoader)
        _VARIANTS[cls] = type(f"Stateful{cls.__name__}", bases, {"__module__": cls.__module__})
    return _VARIANTS[cls]
