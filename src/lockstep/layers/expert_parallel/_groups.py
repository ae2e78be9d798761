"""The process groups of expert parallelism borrowed from data parallelism: ``ep`` innermost, as torchtitan.

``W`` data-parallel ranks (the whole world under DDP) and an ``ep_size`` that divides ``W``:

* the **ep groups** are the ``W / ep_size`` runs of ``ep_size`` consecutive ranks, ``[g * ep_size, (g + 1) *
  ep_size)``; each holds every expert once, rank ``r`` of a group the experts ``[r * E / ep, (r + 1) * E / ep)``,
  and routes its ranks' tokens among them (all-to-all inside the group);
* the **replica groups** are the ranks with the same rank inside their ep group, ``{e, e + ep_size, e + 2 *
  ep_size, ...}``: they hold the same experts, and their expert gradients are summed over them (all-reduce);
* the **data-parallel group** (every rank) computes the router's auxiliary loss over every rank's tokens and
  averages the dense gradients (DDP), as one process on the global batch.

This is torchtitan's convention: its ``ParallelDims`` borrows ``ep`` from the data-parallel shard dimension
as the inner factor (``dp_shard = dp_shard_mod_ep x dp_shard_in_ep``, with ``ep = dp_shard_in_ep`` when
``cp = tp = 1``), so that an ep group is made of consecutive ranks, on one node when it fits (the all-to-all is
the heavier exchange) and the replicas' all-reduce crosses the nodes.

With ``ep_size == W`` there is one ep group (the data-parallel group itself) and no replica group: nothing is
created.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import final

import torch.distributed as dist

from lockstep.layers.expert_parallel._errors import ExpertParallelNotBuiltError, ExpertShardingError


@final
@dataclass(frozen=True)
class ExpertParallelGroups:
    """This rank's expert-parallel groups (built by :func:`expert_parallel_groups`)."""

    data_parallel: dist.ProcessGroup
    """Every rank that routes its own tokens: the router's aux loss and the divisor of the gradients."""
    ep: dist.ProcessGroup
    """The ranks among which this rank's tokens are routed, holding every expert once between them."""
    replicas: dist.ProcessGroup | None
    """The ranks that hold this rank's experts (itself included); None when ``ep`` is the data-parallel group."""

    @property
    def ep_size(self) -> int:
        """The size of the ep group."""
        return dist.get_world_size(self.ep)

    @property
    def ep_rank(self) -> int:
        """This rank's rank in the ep group."""
        return dist.get_rank(self.ep)

    @property
    def data_parallel_size(self) -> int:
        """The number of ranks that each route their own tokens."""
        return dist.get_world_size(self.data_parallel)

    @property
    def num_replicas(self) -> int:
        """How many ranks hold each expert (``data_parallel_size / ep_size``)."""
        return 1 if self.replicas is None else dist.get_world_size(self.replicas)


def check_ep_size(ep_size: int, data_parallel_size: int) -> None:
    """Raise :class:`ExpertShardingError` unless ``ep_size`` divides ``data_parallel_size`` (no collective)."""
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise ExpertShardingError(
            f"expert parallelism with ep_size={ep_size!r} is invalid: it must be an integer >= 1."
        )
    if data_parallel_size % ep_size:
        raise ExpertShardingError(
            f"expert parallelism with ep_size={ep_size} does not fit {data_parallel_size} data-parallel ranks: "
            f"the ranks form groups of ep_size consecutive ranks, so ep_size must divide {data_parallel_size}. "
            f"Pass an ep_size that divides {data_parallel_size}."
        )


def expert_parallel_groups(
    ep_size: int | None = None, data_parallel: dist.ProcessGroup | None = None
) -> ExpertParallelGroups:
    """Build this rank's groups; every rank of the world calls it together, in the same order (``new_group``
    is a collective over the default group).

    Args:
        ep_size: the size of each ep group; None for the whole data-parallel group.
        data_parallel: the data-parallel group; None for the world. A group other than the world takes an
            ``ep_size`` equal to its size only.

    Raises:
        ExpertShardingError: ``ep_size`` does not divide the data-parallel size.
        ExpertParallelNotBuiltError: ``ep_size`` smaller than a data-parallel group that is not the world.
    """
    group = dist.group.WORLD if data_parallel is None else data_parallel
    world = dist.get_world_size(group)
    size = world if ep_size is None else ep_size
    check_ep_size(size, world)
    if size == world:
        return ExpertParallelGroups(data_parallel=group, ep=group, replicas=None)
    if group is not dist.group.WORLD:
        raise ExpertParallelNotBuiltError(
            f"expert parallelism with ep_size={size} over a data-parallel group of {world} of the "
            f"{dist.get_world_size()} processes is not built: ep_size smaller than the data-parallel size "
            "builds its groups out of the whole world. Pass group=None (the world), or ep_size equal to the "
            "group's size."
        )
    rank = dist.get_rank()
    ep, replicas = None, None
    for start in range(0, world, size):  # every rank creates every group, in the same order
        created = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            ep = created
    for first in range(size):
        created = dist.new_group(list(range(first, world, size)))
        if rank % size == first:
            replicas = created
    assert ep is not None and replicas is not None
    return ExpertParallelGroups(data_parallel=group, ep=ep, replicas=replicas)
