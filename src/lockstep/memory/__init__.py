"""Memory: freeing it, finding a batch size that fits, counting what a rank holds, estimating before a run.

``release`` frees memory and retries on out-of-memory (:func:`find_executable_batch_size`);
``accounting`` counts the bytes a rank really holds; ``estimate`` predicts them per strategy.
"""

from lockstep.memory.release import (
    clear_device_cache,
    find_executable_batch_size,
    release_memory,
    should_reduce_batch_size,
)

__all__ = ["clear_device_cache", "find_executable_batch_size", "release_memory", "should_reduce_batch_size"]
