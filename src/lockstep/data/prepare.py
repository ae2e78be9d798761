"""Turning a user's DataLoader into a prepared one: the one place that picks how data is distributed."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from lockstep.config.dataloader import require_torchdata
from lockstep.data.dispatcher import DataLoaderDispatcher
from lockstep.data.loader import DataLoaderShard
from lockstep.data.samplers import (
    BatchSamplerShard,
    IterableDatasetShard,
    RecordingRandomSampler,
    SeedableRandomSampler,
)
from lockstep.state import PartialState
from lockstep.step_hooks import StepHooks

# Settings copied from the original loader; batch_size, shuffle, sampler, batch_sampler and drop_last
# are replaced by the sharded sampler.
_LOADER_SETTINGS = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


def prepare_data_loader(
    dataloader: DataLoader,
    device: torch.device | str | None = None,
    num_processes: int | None = None,
    process_index: int | None = None,
    split_batches: bool = False,
    put_on_device: bool = False,
    rng_types: list[Any] | None = None,
    dispatch_batches: bool | None = None,
    even_batches: bool = True,
    slice_fn_for_dispatch: Callable[..., Any] | None = None,
    use_seedable_sampler: bool = False,
    data_seed: int | None = None,
    non_blocking: bool = False,
    use_stateful_dataloader: bool = False,
    torch_device_mesh: Any = None,
    *,
    step_hooks: StepHooks | None = None,
) -> DataLoader:
    """Wrap ``dataloader`` so that this process reads only its share of every epoch.

    Map-style datasets get a :class:`DataLoaderShard` over a :class:`BatchSamplerShard`; iterable ones
    a :class:`DataLoaderDispatcher` (``dispatch_batches``, the default when ``put_on_device``) or a
    :class:`DataLoaderShard` over an :class:`IterableDatasetShard`. At world size 1 nothing is sharded,
    but the loader still reports ``end_of_dataloader`` and its position.

    Args:
        dataloader: the loader to shard. It is not modified.
        device: where batches go when ``put_on_device`` (default: this process's device).
        num_processes: number of processes (default: from :class:`~lockstep.state.PartialState`).
        process_index: this process's index (default: from :class:`~lockstep.state.PartialState`).
        split_batches: cut each batch of ``dataloader`` across processes (its batch size is then the
            global one) instead of giving each process whole batches.
        put_on_device: move each batch to ``device``.
        rng_types: generators copied from rank 0 at each epoch start (default ``["generator"]``: the
            sampler's, so that shuffling draws the same permutation on every rank).
        dispatch_batches: read on rank 0 and send each process its slice. None means True for iterable
            datasets when ``put_on_device``, else False.
        even_batches: repeat samples from the start of the epoch so every process gets the same number of
            full batches.
        slice_fn_for_dispatch: must be None (batches are dispatched sliced along dim 0).
        use_seedable_sampler: replace a ``RandomSampler`` by a :class:`SeedableRandomSampler`.
        data_seed: seed of that sampler (default: ``torch.initial_seed()``).
        non_blocking: copy batches to the device asynchronously.
        use_stateful_dataloader: make it a torchdata ``StatefulDataLoader`` too, whose state also restores
            datasets with a state of their own (:mod:`lockstep.data._stateful`; needs torchdata).
        torch_device_mesh: must be None (pass the data-parallel ``num_processes`` and ``process_index``).
        step_hooks: the Accelerator's step hooks (:mod:`lockstep.step_hooks`), run over the batches of every
            iteration (lockstep only; the Accelerator passes its own).

    Returns:
        The prepared loader (a ``torch.utils.data.DataLoader``).

    Raises:
        ImportError: ``use_stateful_dataloader=True`` without torchdata installed.
        NotImplementedError: ``slice_fn_for_dispatch`` or ``torch_device_mesh`` is not None.

    Example:
        >>> from torch.utils.data import DataLoader
        >>> loader = prepare_data_loader(DataLoader(range(10), batch_size=2), num_processes=2, process_index=1)
        >>> [batch.tolist() for batch in loader]
        [[2, 3], [6, 7], [0, 1]]
    """
    if not isinstance(dataloader, DataLoader):
        raise TypeError(
            f"prepare_data_loader() needs a torch.utils.data.DataLoader, got {type(dataloader).__name__}."
        )
    _refuse_unsupported(slice_fn_for_dispatch, torch_device_mesh)
    world, rank = _topology(num_processes, process_index)
    iterable = isinstance(dataloader.dataset, IterableDataset)
    if dispatch_batches is None:
        dispatch_batches = put_on_device and iterable
    if split_batches:
        _check_split(dataloader, world)
    target = _target_device(device, put_on_device)
    common = _common_arguments(dataloader, non_blocking, use_stateful_dataloader, step_hooks)
    if dispatch_batches:
        placement = _dispatch_placement(dataloader, use_seedable_sampler, data_seed)
        return DataLoaderDispatcher(
            dataloader.dataset,
            split_batches=split_batches,
            even_batches=even_batches,
            device=target,
            **common,
            **placement,
        )
    if iterable:
        placement, generator = _iterable_placement(dataloader, world, rank, split_batches)
    else:
        placement, generator = _map_placement(
            dataloader, world, rank, split_batches, even_batches, use_seedable_sampler, data_seed
        )
    return DataLoaderShard(
        placement.pop("dataset"),
        device=target,
        rng_types=["generator"] if rng_types is None else list(rng_types),
        synchronized_generator=generator,
        **common,
        **placement,
    )


def skip_first_batches(dataloader: DataLoader, num_batches: int = 0) -> DataLoader:
    """A loader that skips the first ``num_batches`` batches of every epoch.

    For prepared map-style loaders (and plain map-style DataLoaders) the skip is O(1): the sampler starts
    at the right batch. Iterable data is read and discarded up to that point. The new loader shares the
    sampler and its generator with ``dataloader``, so it continues the same order.

    Example:
        >>> from torch.utils.data import DataLoader
        >>> [batch.tolist() for batch in skip_first_batches(DataLoader(range(6), batch_size=2), 2)]
        [[4, 5]]
    """
    if num_batches < 0:
        raise ValueError(f"skip_first_batches(num_batches={num_batches}) is invalid: it must be >= 0.")
    if isinstance(dataloader, (DataLoaderShard, DataLoaderDispatcher)):
        return dataloader._with_skip(num_batches)  # with the step hooks of the loader it continues
    settings = _loader_settings(dataloader)
    if isinstance(dataloader.dataset, IterableDataset):
        placement: dict[str, Any] = _batching(dataloader.batch_size, dataloader.drop_last)
    else:
        batch_sampler, as_sampler = _original_batch_sampler(dataloader)
        if batch_sampler is None:
            placement = {"sampler": dataloader.sampler, "batch_size": None}
        else:
            shard = BatchSamplerShard(batch_sampler, 1, 0, even_batches=False)
            placement = {"sampler": shard, "batch_size": None} if as_sampler else {"batch_sampler": shard}
    return DataLoaderShard(
        dataloader.dataset, skip_batches=num_batches, _drop_last=dataloader.drop_last, **placement, **settings
    )


# -- building blocks --------------------------------------------------------------------------------
def _refuse_unsupported(slice_fn_for_dispatch: Callable[..., Any] | None, torch_device_mesh: Any) -> None:
    """Accelerate's two arguments lockstep's loaders do not honour: refused rather than ignored."""
    if slice_fn_for_dispatch is not None:
        raise NotImplementedError(
            f"prepare_data_loader(slice_fn_for_dispatch={slice_fn_for_dispatch!r}) is not supported: lockstep's "
            "DataLoaderDispatcher slices every tensor of a dispatched batch along dim 0. Leave it None, or "
            "dispatch_batches=False so that each process reads its own batches."
        )
    if torch_device_mesh is not None:
        raise NotImplementedError(
            "prepare_data_loader(torch_device_mesh=...) is not supported: lockstep does not read the data-parallel "
            "shard from a mesh here. Pass num_processes and process_index of the data-parallel group (Accelerator."
            "prepare does this from its ParallelismConfig)."
        )


def _topology(num_processes: int | None, process_index: int | None) -> tuple[int, int]:
    if num_processes is None or process_index is None:
        state = PartialState()
        num_processes = state.num_processes if num_processes is None else num_processes
        process_index = state.process_index if process_index is None else process_index
    if num_processes < 1 or not 0 <= process_index < num_processes:
        raise ValueError(
            f"prepare_data_loader(num_processes={num_processes}, process_index={process_index}) is invalid: "
            "the number of processes must be >= 1 and the index in [0, num_processes)."
        )
    return num_processes, process_index


def _target_device(device: torch.device | str | None, put_on_device: bool) -> torch.device | str | None:
    if not put_on_device:
        return None
    return PartialState().device if device is None else device


def _common_arguments(
    dataloader: DataLoader, non_blocking: bool, stateful: bool, step_hooks: StepHooks | None
) -> dict[str, Any]:
    """The prepared loader's own arguments whatever its class, and the settings copied from ``dataloader``."""
    if stateful:
        require_torchdata("prepare_data_loader(use_stateful_dataloader=True)")
    return {
        "_drop_last": dataloader.drop_last,
        "_non_blocking": non_blocking,
        "use_stateful_dataloader": stateful,
        "step_hooks": step_hooks,
        **_loader_settings(dataloader),
    }


def _loader_settings(dataloader: DataLoader) -> dict[str, Any]:
    return {name: getattr(dataloader, name) for name in _LOADER_SETTINGS if hasattr(dataloader, name)}


def _batching(batch_size: int | None, drop_last: bool) -> dict[str, Any]:
    # DataLoader refuses drop_last together with batch_size=None (no automatic batching).
    return (
        {"batch_size": batch_size}
        if batch_size is None
        else {"batch_size": batch_size, "drop_last": drop_last}
    )


def _declared_batch_size(dataloader: DataLoader) -> int | None:
    if dataloader.batch_size is not None:
        return dataloader.batch_size
    batch_sampler, _ = _original_batch_sampler(dataloader)
    return getattr(batch_sampler, "batch_size", None)


def _check_split(dataloader: DataLoader, world: int) -> None:
    size = _declared_batch_size(dataloader)
    if size is None:
        batch_sampler, _ = _original_batch_sampler(dataloader)
        raise ValueError(
            "prepare_data_loader(split_batches=True) needs the batch size to cut each batch into equal "
            f"slices, but the DataLoader has batch_size=None and its batch sampler "
            f"({type(batch_sampler).__name__}) has no `batch_size` attribute. Give the batch sampler a "
            "`batch_size`, or pass split_batches=False."
        )
    if size % world != 0:
        raise ValueError(
            f"prepare_data_loader(split_batches=True) needs the batch size ({size}) to be a round multiple "
            f"of the number of processes ({world}), since each batch is cut into {world} equal slices. "
            f"Use a batch size divisible by {world}, or pass split_batches=False."
        )


def _original_batch_sampler(dataloader: DataLoader) -> tuple[Any, bool]:
    """The loader's batch sampler, and whether it was passed as ``sampler=`` (with batch_size=None)."""
    if dataloader.batch_sampler is None and isinstance(dataloader.sampler, BatchSampler):
        return dataloader.sampler, True
    return dataloader.batch_sampler, False


def _fresh_seed() -> int:
    """A seed drawn from the global generator (reproducible under set_seed, distinct per loader)."""
    return int(torch.empty((), dtype=torch.int64).random_().item())


def _own_sampler(
    batch_sampler: Any, use_seedable: bool, data_seed: int | None, *, one_process: bool = False
) -> tuple[Any, Any]:
    """A batch sampler whose shuffling is reproducible, and the generator to keep in sync (or None).

    A ``RandomSampler`` becomes a :class:`SeedableRandomSampler`; without a generator of its own it gets
    one on several processes (it would otherwise draw a fresh seed per epoch from the global generator,
    which ranks do not share). On one process it keeps drawing from the global generator, as the plain
    ``DataLoader`` does, and records each epoch's seed to replay it on resume
    (:class:`RecordingRandomSampler`): adding the four lines changes no random number. The user's objects
    are copied, not modified.
    """
    sampler = getattr(batch_sampler, "sampler", None)
    if isinstance(sampler, SeedableRandomSampler):
        return batch_sampler, None
    if isinstance(sampler, RandomSampler) and use_seedable:
        seedable = SeedableRandomSampler(
            sampler.data_source,  # type: ignore[arg-type]
            replacement=sampler.replacement,
            num_samples=sampler._num_samples,
            data_seed=data_seed,
        )
        return _replace_sampler(batch_sampler, seedable), None
    if isinstance(sampler, RandomSampler) and sampler.generator is None and one_process:
        recording = RecordingRandomSampler(
            sampler.data_source,  # type: ignore[arg-type]
            replacement=sampler.replacement,
            num_samples=sampler._num_samples,
        )
        return _replace_sampler(batch_sampler, recording), None
    if isinstance(sampler, RandomSampler) and sampler.generator is None:
        owned = copy.copy(sampler)
        owned.generator = torch.Generator()
        owned.generator.manual_seed(_fresh_seed())
        return _replace_sampler(batch_sampler, owned), owned.generator
    generator = getattr(sampler, "generator", None)
    return batch_sampler, generator if isinstance(generator, torch.Generator) else None


def _replace_sampler(batch_sampler: Any, sampler: Any) -> Any:
    if type(batch_sampler) is BatchSampler:
        return BatchSampler(sampler, batch_sampler.batch_size, batch_sampler.drop_last)
    replaced = copy.copy(batch_sampler)
    replaced.sampler = sampler
    return replaced


def _map_placement(
    dataloader: DataLoader,
    world: int,
    rank: int,
    split_batches: bool,
    even_batches: bool,
    use_seedable: bool,
    data_seed: int | None,
) -> tuple[dict[str, Any], Any]:
    batch_sampler, as_sampler = _original_batch_sampler(dataloader)
    if batch_sampler is None:
        if world > 1:
            raise ValueError(
                "prepare_data_loader() cannot shard a DataLoader with batch_size=None and a per-sample "
                f"sampler ({type(dataloader.sampler).__name__}) across {world} processes: there are no "
                "batches to deal out. Pass batch_size=1, or a batch_sampler."
            )
        return {"dataset": dataloader.dataset, "sampler": dataloader.sampler, "batch_size": None}, None
    batch_sampler, generator = _own_sampler(batch_sampler, use_seedable, data_seed, one_process=world == 1)
    if world > 1:
        shard = BatchSamplerShard(batch_sampler, world, rank, split_batches, even_batches)
    else:  # identity: Accelerate does not touch the batches of a single process
        shard = BatchSamplerShard(batch_sampler, 1, 0, even_batches=False)
    placement = {"sampler": shard, "batch_size": None} if as_sampler else {"batch_sampler": shard}
    return {"dataset": dataloader.dataset, **placement}, generator


def _iterable_placement(
    dataloader: DataLoader, world: int, rank: int, split_batches: bool
) -> tuple[dict[str, Any], Any]:
    dataset, size = dataloader.dataset, dataloader.batch_size
    generator = getattr(dataset, "generator", None)
    generator = generator if isinstance(generator, torch.Generator) else None
    if world == 1:
        return {"dataset": dataset, **_batching(size, dataloader.drop_last)}, generator
    shard = IterableDatasetShard(
        dataset,
        batch_size=1 if size is None else size,  # batch_size=None: every item is already a batch
        drop_last=dataloader.drop_last,
        num_processes=world,
        process_index=rank,
        split_batches=split_batches,
    )
    per_process = None if size is None else (size // world if split_batches else size)
    return {"dataset": shard, **_batching(per_process, dataloader.drop_last)}, generator


def _dispatch_placement(dataloader: DataLoader, use_seedable: bool, data_seed: int | None) -> dict[str, Any]:
    if isinstance(dataloader.dataset, IterableDataset):
        return _batching(dataloader.batch_size, dataloader.drop_last)
    batch_sampler, as_sampler = _original_batch_sampler(dataloader)
    if batch_sampler is None:
        return {"sampler": dataloader.sampler, "batch_size": None}
    batch_sampler, _ = _own_sampler(batch_sampler, use_seedable, data_seed)
    shard = BatchSamplerShard(batch_sampler, 1, 0, even_batches=False)  # identity with an O(1) skip
    return {"sampler": shard, "batch_size": None} if as_sampler else {"batch_sampler": shard}
