"""The N-D backend: tensor parallelism over ``tp``, context parallelism over ``cp``, then FSDP2 over
``dp_shard_cp`` (HSDP with ``dp_replicate``).

torchtitan's recipe, on torch's own pieces: the ``ParallelismConfig`` owns the mesh; the model is first
split by :func:`~lockstep.backends.nd.tensor_parallel.apply_tensor_parallel` (``parallelize_module`` on
``mesh["tp"]``), then sharded with ``fully_shard`` over ``dp_shard_cp`` (a 2-D ``(dp_replicate,
dp_shard_cp)`` mesh for HSDP; :mod:`lockstep.backends.nd.mesh`). Everything else (optimizer re-binding,
gradient sync, checkpoints through ``torch.distributed.checkpoint``) is every sharding backend's
(:class:`~lockstep.backends.fsdp.sharded.ShardedBackend`); DTensors on a 2-D mesh go through the same code. Gradient clipping reduces each gradient over the mesh dimensions it is sharded on
(:mod:`lockstep.backends.fsdp.clipping`).

Dataloaders shard by the data-parallel rank only: the processes of one ``tp`` or ``cp`` group get the same
batch. With ``cp_size > 1``, ``maybe_context_parallel`` splits that batch along the sequence and runs SDPA as
torch's ring attention (:mod:`lockstep.backends.nd.context_parallel`); the model is sharded over ``dp_shard x
cp``, so FSDP averages the gradients of the ``cp`` ranks too: with a loss that is a mean over each rank's
tokens (equal counts: the sequence splits evenly), that average is the gradient of the whole sequence.

On gloo, FSDP2's gradient reductions are switched to plain sums (gloo has no ``PREMUL_SUM``; see
:func:`lockstep.backends.nd.mesh.sum_reductions_on_gloo`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, final

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lockstep.backends.base import DataShard
from lockstep.backends.capabilities import C, ContextParallel, no_context_parallel
from lockstep.backends.fsdp.plugin import FullyShardedDataParallelPlugin
from lockstep.backends.fsdp.precision import FSDPPrecision
from lockstep.backends.fsdp.sharded import ShardedBackend, gathered_state_dict, parameter_owners
from lockstep.backends.nd.mesh import MeshLayout, sum_reductions_on_gloo
from lockstep.backends.nd.tensor_parallel import apply_tensor_parallel
from lockstep.config.parallelism import ParallelismConfig
from lockstep.config.plugins import TorchDynamoPlugin
from lockstep.state import PartialState


@final
class NDParallelBackend(ShardedBackend, ContextParallel):
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
        self.layout = MeshLayout(state, config, owner=type(self).__name__)
        if plugin.cpu_ram_efficient_loading and config.tp_enabled:
            raise NotImplementedError(
                "FullyShardedDataParallelPlugin(cpu_ram_efficient_loading=True) with tp_size > 1 is not built yet: "
                "tensor parallelism needs the weights on every process. Set cpu_ram_efficient_loading=False."
            )
        self.config = config
        self.distributed_type = self.layout.distributed_type

    @property
    def mesh(self) -> DeviceMesh | None:
        """The FSDP mesh of the layout (:attr:`MeshLayout.fsdp_mesh`)."""
        return self.layout.fsdp_mesh

    def data_shard(self) -> DataShard:
        """This process's data-parallel replica: ranks differing only in ``tp``/``cp`` share a batch."""
        return self.layout.data_shard()

    def data_parallel_group(self) -> dist.ProcessGroup | None:
        """One process per data-parallel replica (:meth:`MeshLayout.replica_group`); with tensor parallelism
        alone (no data-parallel dimension) a group of this process only. None when every process is a
        replica of its own (no tensor or context parallelism)."""
        if not self.config.non_dp_dim_names:
            return None
        return self.layout.replica_group()

    # -- models -----------------------------------------------------------------------------------
    def wrap_model(self, model: nn.Module, *, device_placement: bool = True) -> nn.Module:
        self._check_wrappable(model)
        if device_placement:
            model = model.to(self.device)
        if self.config.cp_enabled:
            from lockstep.backends.nd.context_parallel import check_sdpa_attention

            check_sdpa_attention(model, self.config.cp_size)
        owners = parameter_owners(model)
        if self.config.tp_enabled:
            plan = self.config.tp_handler.parallelize_plan if self.config.tp_handler else None
            apply_tensor_parallel(model, self.config.get_submesh("tp"), plan)
        fsdp_mesh = self.mesh
        if fsdp_mesh is not None:
            self._shard(model, fsdp_mesh)
            sum_reductions_on_gloo(model)
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
        return gathered_state_dict(getattr(model, "_orig_mod", model))
