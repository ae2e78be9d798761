"""torch's distributed module wrappers, asked about here instead of by name outside ``backends/``.

Whether a model is a ``DistributedDataParallel``, ``DataParallel``, FSDP1 ``FullyShardedDataParallel`` or an
FSDP2 ``FSDPModule`` tells which backend prepared it; code outside the backends calls these functions (and
``tests/test_architecture_spellings.py`` checks that it names none of those classes).

Example:
    >>> from torch import nn
    >>> is_distributed_module(nn.Linear(2, 2))
    False
    >>> nn.parallel.DistributedDataParallel in module_wrappers()
    True
"""

from __future__ import annotations

import torch
from torch import nn


def module_wrappers() -> tuple[type, ...]:
    """torch's wrappers that hold the user's module as ``.module``: ``DistributedDataParallel``,
    ``DataParallel`` and, where ``torch.distributed`` is built, FSDP1's ``FullyShardedDataParallel`` (a model
    given to Accelerate's ``extract_model_from_parallel`` may come from anywhere)."""
    wrappers: tuple[type, ...] = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    if torch.distributed.is_available():
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrappers += (FullyShardedDataParallel,)
    return wrappers


def is_distributed_module(module: nn.Module) -> bool:
    """Whether DDP wraps ``module`` or FSDP2's ``fully_shard`` sharded it (the backends' model wrappers)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, nn.parallel.DistributedDataParallel | FSDPModule)
