"""``accelerate.utils.memory``: freeing memory and finding a batch size that fits.

The functions are :mod:`lockstep.memory`'s.

Example:
    >>> @find_executable_batch_size(starting_batch_size=8)
    ... def train(batch_size):
    ...     return batch_size
    >>> train()
    8
"""

from lockstep.memory import (
    clear_device_cache,
    find_executable_batch_size,
    release_memory,
    should_reduce_batch_size,
)

__all__ = ["clear_device_cache", "find_executable_batch_size", "release_memory", "should_reduce_batch_size"]
