"""What the N-D and pipeline backends read off the ``ParallelismConfig``'s device mesh.

Both shard with FSDP2 over ``dp_shard_cp`` (a 2-D ``(dp_replicate, dp_shard_cp)`` mesh for HSDP), split
the data by the ``dp`` sub-mesh only (the ranks of one ``tp``/``cp`` group, or of one pipeline, read the
same batch), and gather metrics over one process per data-parallel replica. :class:`MeshLayout` answers
these questions for both; :func:`sum_reductions_on_gloo` is the gloo workaround both apply after sharding.

gloo has no ``ReduceOp.PREMUL_SUM``, which FSDP2 uses for a gradient divide factor other than the shard
group's size (``set_gradient_divide_factor``); on gloo every sharded module is switched to plain sums with
the division done apart (``set_force_sum_reduction_for_comms``), which gives the same average.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from lockstep.backends.base import DataShard
from lockstep.config.enums import DistributedType
from lockstep.config.parallelism import ParallelismConfig
from lockstep.config.topology import data_parallel_type
from lockstep.state import PartialState


class MeshLayout:
    """The FSDP mesh, the data shard and the replica group of a ``ParallelismConfig`` whose mesh is built.

    Args:
        state: the process state.
        config: the layout.
        owner: the backend's name, for the error raised when the mesh is not built.
    """

    def __init__(self, state: PartialState, config: ParallelismConfig, *, owner: str) -> None:
        if config.device_mesh is None:
            raise RuntimeError(f"{owner} needs the ParallelismConfig's device mesh built first.")
        self.state = state
        self.config = config
        self._own_group: dist.ProcessGroup | None = None

    @property
    def distributed_type(self) -> DistributedType:
        """FSDP when some dimension shards the model, else plain data parallelism over the processes."""
        config = self.config
        if config.dp_shard_enabled or config.cp_enabled or config.dp_replicate_enabled:
            return DistributedType.FSDP
        return data_parallel_type(processes=self.state.num_processes, cpu=self.state.device.type == "cpu")

    @property
    def fsdp_mesh(self) -> DeviceMesh | None:
        """The mesh ``fully_shard`` shards over: ``dp_shard_cp``, or ``(dp_replicate, dp_shard_cp)`` for HSDP;
        None without a dimension to shard over."""
        config = self.config
        if not config.dp_shard_cp_dim_names:
            # dp_replicate alone with tp is refused by ParallelismConfig; tp alone has no data parallelism
            return None
        return config.get_submesh(config.fsdp_dim_names)

    def data_shard(self) -> DataShard:
        """This process's data-parallel replica: ranks differing only in ``tp``/``cp``/``pp`` share a batch."""
        if not self.config.dp_dim_names:
            return DataShard(index=0, count=1)
        dp = self.config.get_submesh("dp")
        return DataShard(index=dp.get_local_rank(), count=dp.size())

    def replica_group(self) -> dist.ProcessGroup:
        """One process per data-parallel replica: the ``dp`` sub-mesh's group, which holds this process and
        the processes at the same ``tp``/``cp``/``pp`` coordinates in the other replicas; without a
        data-parallel dimension a group of this process only."""
        if self.config.dp_dim_names:
            return self.config.get_submesh("dp").get_group()
        if self._own_group is None:
            # Only this process takes part, so no other process has to call new_group at the same time.
            self._own_group = dist.new_group([self.state.process_index], use_local_synchronization=True)
        return self._own_group


def sum_reductions_on_gloo(model: nn.Module) -> None:
    """On gloo, make FSDP2 reduce ``model``'s gradients with SUM plus a separate division, never gloo's
    missing PREMUL_SUM; nothing on other process-group backends."""
    if dist.get_backend() != "gloo":
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
