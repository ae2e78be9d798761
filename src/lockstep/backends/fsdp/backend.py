"""Fully sharded data parallel training with FSDP2 (``torch.distributed.fsdp.fully_shard``).

Each process keeps 1/N of every parameter, gradient and optimizer state (a DTensor sharded on dim 0);
parameters are all-gathered per unit for forward and backward, and gradients are reduce-scattered.
This backend shards over all processes (a 1-D mesh) and can load pretrained weights on the main process
only (``cpu_ram_efficient_loading``, :mod:`.loading`); the unit choice (:mod:`.units`), optimizer
re-binding, gradient sync switch, clipping, precision and checkpoints are every sharding backend's
(:class:`~lockstep.backends.fsdp.sharded.ShardedBackend`).
"""

from __future__ import annotations

from typing import final

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lockstep.backends.fsdp.loading import broadcast_from_main, to_meta
from lockstep.backends.fsdp.sharded import ShardedBackend, parameter_owners
from lockstep.config.enums import DistributedType


@final
class FSDPBackend(ShardedBackend):
    """Shard models with FSDP2 across all processes (a 1-D device mesh).

    Args:
        state: the process state.
        plugin: the FSDP settings.
        precision: the Accelerator's mixed precision; it wraps the forward in autocast like every backend's
            and becomes the ``MixedPrecisionPolicy`` unless the plugin sets one.
        dynamo_plugin: ``torch.compile`` settings (applied to the sharded model).
    """

    distributed_type = DistributedType.FSDP
    _mesh: DeviceMesh | None = None  # built on first use of :attr:`mesh`

    @property
    def mesh(self) -> DeviceMesh:
        """Every process, in one dimension (built on first use)."""
        if self._mesh is None:
            self._mesh = init_device_mesh(self.device.type, (self.state.num_processes,))
        return self._mesh

    # -- models -----------------------------------------------------------------------------------
    def wrap_model(self, model: nn.Module, *, device_placement: bool = True) -> nn.Module:
        self._check_wrappable(model)
        efficient = self.plugin.cpu_ram_efficient_loading
        full_state: dict[str, torch.Tensor] = {}
        buffers: dict[str, torch.Tensor] = {}
        if efficient:
            full_state, buffers = self._take_weights_off(model)
        elif device_placement:
            model = model.to(self.device)
        owners = parameter_owners(model)
        self._shard(model, self.mesh)
        if efficient:
            model.to_empty(device="cpu" if self.plugin.cpu_offload else self.device)
            broadcast_from_main(model, full_state, buffers, self.state)
        self._record_replacements(owners)
        self.sharded_models.append(model)
        return model

    def _take_weights_off(self, model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Keep the main process's weights aside and move every process's model to the meta device."""
        full_state: dict[str, torch.Tensor] = {}
        buffers: dict[str, torch.Tensor] = {}
        if self.state.is_main_process:
            if any(t.is_meta for t in model.state_dict().values()):
                raise ValueError(
                    "cpu_ram_efficient_loading: the main process's model is on the meta device, but it must hold "
                    "the pretrained weights that are sent to the other processes. Load the weights on the main "
                    "process (the others may build the model on the meta device)."
                )
            full_state = {k: v.detach() for k, v in model.state_dict().items()}
            persistent = set(full_state)
            buffers = {n: b.detach() for n, b in model.named_buffers() if n not in persistent}
        to_meta(model)
        return full_state, buffers
