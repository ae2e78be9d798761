"""The N-D backend: tensor parallelism over ``tp``, context parallelism over ``cp``, then FSDP2 over
``dp_shard_cp`` (HSDP with ``dp_replicate``).

torchtitan's recipe, on torch's own pieces: the ``ParallelismConfig`` owns the mesh; the model is first
split by :func:`~lockstep.backends.nd.tensor_parallel.apply_tensor_parallel` (``parallelize_module`` on
``mesh["tp"]``), then sharded by the FSDP backend's ``fully_shard`` over ``dp_shard_cp`` (a 2-D
``(dp_replicate, dp_shard_cp)`` mesh for HSDP). Everything else (optimizer re-binding, gradient sync,
checkpoints through ``torch.distributed.checkpoint``) is the FSDP backend's; DTensors on a 2-D mesh go
through the same code. Gradient clipping reduces each gradient over the mesh dimensions it is sharded on
(:mod:`lockstep.backends.fsdp.clipping`).

Dataloaders shard by the data-parallel rank only: the processes of one ``tp`` or ``cp`` group get the same
batch. With ``cp_size > 1``, ``maybe_context_parallel`` splits that batch along the sequence and runs SDPA as
torch's ring attention (:mod:`lockstep.backends.nd.context_parallel`); the model is sharded over ``dp_shard x
cp``, so FSDP averages the gradients of the ``cp`` ranks too: with a loss that is a mean over each rank's
tokens (equal counts: the sequence splits evenly), that average is the gradient of the whole sequence.

gloo has no ``ReduceOp.PREMUL_SUM``, which FSDP2 uses for a gradient divide factor other than the shard
group's size (``set_gradient_divide_factor``); on gloo every sharded module is switched to plain sums with
the division done apart (``set_force_sum_reduction_for_comms``), which gives the same average.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from lockstep.backends.base import DataShard
from lockstep.backends.capabilities import C, ContextParallel, no_context_parallel
from lockstep.backends.fsdp.backend import FSDPBackend, _parameter_owners
from lockstep.backends.fsdp.precision import FSDPPrecision
from lockstep.backends.nd.tensor_parallel import apply_tensor_parallel
from lockstep.config.enums import DistributedType
from lockstep.config.fsdp import FullyShardedDataParallelPlugin
from lockstep.config.parallelism import ParallelismConfig
from lockstep.config.plugins import TorchDynamoPlugin
from lockstep.config.topology import data_parallel_type
from lockstep.state import PartialState


class NDParallelBackend(FSDPBackend, ContextParallel):
    """Tensor parallel, context parallel, FSDP2 and HSDP composed on the ``ParallelismConfig``'s device mesh.

    Args:
        state: the process state.
        config: the layout; its mesh is built already.
        plugin: FSDP settings for the ``dp_shard`` dimension (wrap policy, resharding, offload...).
        precision: the Accelerator's mixed precision.
        dynamo_plugin: ``torch.compile`` settings.
    """

    def __init__(
        self,
        state: PartialState,
        *,
        config: ParallelismConfig,
        plugin: FullyShardedDataParallelPlugin,
        precision: FSDPPrecision,
        dynamo_plugin: TorchDynamoPlugin | None = None,
    ) -> None:
        super().__init__(state, plugin=plugin, precision=precision, dynamo_plugin=dynamo_plugin)
        if config.device_mesh is None:
            raise RuntimeError("NDParallelBackend needs the ParallelismConfig's device mesh built first.")
        if plugin.cpu_ram_efficient_loading and config.tp_enabled:
            raise NotImplementedError(
                "FullyShardedDataParallelPlugin(cpu_ram_efficient_loading=True) with tp_size > 1 is not built yet: "
                "tensor parallelism needs the weights on every process. Set cpu_ram_efficient_loading=False."
            )
        self.config = config
        self._own_group: dist.ProcessGroup | None = None
        shards = config.dp_shard_enabled or config.cp_enabled or config.dp_replicate_enabled
        self.distributed_type = (
            DistributedType.FSDP
            if shards
            else data_parallel_type(processes=state.num_processes, cpu=state.device.type == "cpu")
        )

    @property
    def mesh(self) -> DeviceMesh:
        """The mesh ``fully_shard`` shards over: ``dp_shard_cp``, or ``(dp_replicate, dp_shard_cp)`` for HSDP."""
        assert self._fsdp_mesh is not None, "no data-parallel dimension: nothing to shard over"
        return self._fsdp_mesh

    @property
    def _fsdp_mesh(self) -> DeviceMesh | None:
        config = self.config
        if not config.dp_shard_cp_dim_names:
            # dp_replicate alone with tp is refused by ParallelismConfig; tp alone has no data parallelism
            return None
        return config.get_submesh(config.fsdp_dim_names)

    def data_shard(self) -> DataShard:
        """This process's data-parallel replica: ranks differing only in ``tp``/``cp`` share a batch."""
        if not self.config.dp_dim_names:
            return DataShard(index=0, count=1)
        dp = self.config.get_submesh("dp")
        return DataShard(index=dp.get_local_rank(), count=dp.size())

    def data_parallel_group(self) -> dist.ProcessGroup | None:
        """One process per data-parallel replica: the ``dp`` sub-mesh's group, which holds this process and
        the processes at the same ``tp``/``cp`` coordinates in the other replicas. With tensor parallelism
        alone (no data-parallel dimension) a group of this process only. None when every process is a
        replica of its own (no tensor or context parallelism)."""
        config = self.config
        if not config.non_dp_dim_names:
            return None
        if config.dp_dim_names:
            return config.get_submesh("dp").get_group()
        if self._own_group is None:
            # Only this process takes part, so no other process has to call new_group at the same time.
            self._own_group = dist.new_group([self.state.process_index], use_local_synchronization=True)
        return self._own_group

    # -- models -----------------------------------------------------------------------------------
    def wrap_model(self, model: nn.Module, *, device_placement: bool = True) -> nn.Module:
        self._check_wrappable(model)
        if device_placement:
            model = model.to(self.device)
        if self.config.cp_enabled:
            from lockstep.backends.nd.context_parallel import check_sdpa_attention

            check_sdpa_attention(model, self.config.cp_size)
        owners = _parameter_owners(model)
        if self.config.tp_enabled:
            plan = self.config.tp_handler.parallelize_plan if self.config.tp_handler else None
            apply_tensor_parallel(model, self.config.get_submesh("tp"), plan)
        fsdp_mesh = self._fsdp_mesh
        if fsdp_mesh is not None:
            self._shard(model, fsdp_mesh)
            if dist.get_backend() == "gloo":
                _sum_reductions_only(model)
        self._record_replacements(owners)
        self.sharded_models.append(model)
        return model

    def capability(self, kind: type[C]) -> C | None:
        """As every backend's, except that context parallelism is there only with ``cp_size > 1``."""
        if kind is ContextParallel and not self.config.cp_enabled:
            return None
        return super().capability(kind)

    def context_parallel(
        self,
        buffers: Sequence[torch.Tensor] | None,
        buffer_seq_dims: Sequence[int] | None,
        no_restore_buffers: set[torch.Tensor] | None,
    ) -> contextlib.AbstractContextManager:
        """With ``cp_size > 1``: split ``buffers`` along the sequence over ``cp`` and run SDPA as torch's ring
        attention while the block runs (on CPUs too); otherwise the base class's no-op."""
        if not self.config.cp_enabled:
            return no_context_parallel()
        from lockstep.backends.nd.context_parallel import context_parallel_region

        assert self.config.cp_handler is not None
        return context_parallel_region(
            self.config.get_submesh("cp"),
            buffers=buffers,
            buffer_seq_dims=buffer_seq_dims,
            no_restore_buffers=no_restore_buffers,
            comm_strategy=str(self.config.cp_handler.cp_comm_strategy),
        )

    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The whole model's weights gathered on the main process, whether FSDP, TP or both split them."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        target = getattr(model, "_orig_mod", model)
        return get_model_state_dict(target, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _sum_reductions_only(model: nn.Module) -> None:
    """Make FSDP2 reduce gradients with SUM plus a separate division, never gloo's missing PREMUL_SUM."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
