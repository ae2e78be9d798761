"""Accelerate's ``accelerate.data_loader`` import path: the sharded, resumable loaders live in :mod:`lockstep.data`.

Example:
    >>> from torch.utils.data import DataLoader
    >>> from lockstep.data_loader import prepare_data_loader
    >>> loader = prepare_data_loader(DataLoader(range(8), batch_size=2), num_processes=2, process_index=1)
    >>> [batch.tolist() for batch in loader]
    [[2, 3], [6, 7]]
"""

from lockstep.data import (
    BatchSamplerShard,
    DataLoaderDispatcher,
    DataLoaderShard,
    DataLoaderStateMixin,
    IterableDatasetShard,
    SeedableRandomSampler,
    prepare_data_loader,
    skip_first_batches,
)

__all__ = [
    "BatchSamplerShard",
    "DataLoaderDispatcher",
    "DataLoaderShard",
    "DataLoaderStateMixin",
    "IterableDatasetShard",
    "SeedableRandomSampler",
    "prepare_data_loader",
    "skip_first_batches",
]
