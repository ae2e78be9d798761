"""Sharded, resumable dataloaders with Accelerate's ``prepare_data_loader`` semantics.

Example:
    >>> from torch.utils.data import DataLoader
    >>> from lockstep.data import prepare_data_loader
    >>> loader = prepare_data_loader(DataLoader(range(8), batch_size=2), num_processes=2, process_index=0)
    >>> [batch.tolist() for batch in loader]
    [[0, 1], [4, 5]]
"""

from lockstep.data.dispatcher import DataLoaderDispatcher
from lockstep.data.loader import DataLoaderShard, DataLoaderStateMixin
from lockstep.data.prepare import prepare_data_loader, skip_first_batches
from lockstep.data.samplers import BatchSamplerShard, IterableDatasetShard, SeedableRandomSampler

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
