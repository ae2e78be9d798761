"""Fully sharded data parallel training with FSDP2 (``torch.distributed.fsdp.fully_shard``).

Each process keeps 1/N of every parameter, gradient and optimizer state (a DTensor sharded on dim 0);
parameters are all-gathered per unit for forward and backward, and gradients are reduce-scattered.
This module decides the units, applies torch's ``fully_shard`` to them, re-binds optimizers built
before sharding, and implements the backend interface (gradient sync switch, global-norm clipping).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from lockstep import _env
from lockstep.backends.base import Backend
from lockstep.backends.fsdp.loading import broadcast_from_main, to_meta
from lockstep.backends.fsdp.units import ignored_parameters, select_units
from lockstep.checkpoint.sharded import ShardedObjects
from lockstep.config.enums import DistributedType
from lockstep.config.fsdp import FullyShardedDataParallelPlugin
from lockstep.config.plugins import TorchDynamoPlugin
from lockstep.state import PartialState

logger = logging.getLogger("lockstep.fsdp")


class FSDPBackend(Backend):
    """Shard models with FSDP2 across all processes (a 1-D device mesh).

    Args:
        state: the process state.
        plugin: the FSDP settings.
        mixed_precision: the Accelerator's ``mixed_precision`` (``no``, ``bf16``, ``fp16``), which becomes
            the ``MixedPrecisionPolicy`` unless the plugin sets one.
        dynamo_plugin: ``torch.compile`` settings (applied to the sharded model).
    """

    distributed_type = DistributedType.FSDP

    def __init__(
        self,
        state: PartialState,
        *,
        plugin: FullyShardedDataParallelPlugin,
        mixed_precision: str = "no",
        dynamo_plugin: TorchDynamoPlugin | None = None,
    ) -> None:
        super().__init__(state, dynamo_plugin=dynamo_plugin)
        self.plugin = plugin
        self.mp_policy = plugin.mixed_precision(mixed_precision)
        # Pinned memory needs an accelerator; on a CPU-only machine the offload path runs unpinned.
        pinned = self.device.type != "cpu"
        self.offload_policy: OffloadPolicy = (
            CPUOffloadPolicy(pin_memory=pinned) if plugin.cpu_offload else OffloadPolicy()
        )
        self._mesh: DeviceMesh | None = None
        self.sharded_models: list[nn.Module] = []
        # id(original parameter) -> (weak reference to it, the sharded parameter that replaced it)
        self._replacements: dict[int, tuple[weakref.ref, nn.Parameter]] = {}
        if plugin.cpu_ram_efficient_loading:
            _env.announce_rank0_loading()

    @property
    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            self._mesh = init_device_mesh(self.device.type, (self.state.num_processes,))
        return self._mesh

    # -- models -----------------------------------------------------------------------------------
    def prepare_model(
        self, model: nn.Module, *, device_placement: bool, evaluation_mode: bool = False
    ) -> nn.Module:
        if evaluation_mode:
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)
        model = self.wrap_model(model, device_placement=device_placement)
        if self.dynamo_plugin is not None and self.dynamo_plugin.enabled:
            model = torch.compile(model, **self.dynamo_plugin.compile_kwargs())  # type: ignore[assignment]
        return model

    def wrap_model(self, model: nn.Module, *, device_placement: bool = True) -> nn.Module:
        self._check_wrappable(model)
        efficient = self.plugin.cpu_ram_efficient_loading
        full_state: dict[str, torch.Tensor] = {}
        buffers: dict[str, torch.Tensor] = {}
        if efficient:
            full_state, buffers = self._take_weights_off(model)
        elif device_placement:
            model = model.to(self.device)
        units = select_units(model, self.plugin)
        if self.plugin.activation_checkpointing:
            units = _checkpoint_activations(model, units)
        owners = _parameter_owners(model)
        shard = functools.partial(
            fully_shard,
            mesh=self.mesh,
            reshard_after_forward=self.plugin.reshard_after_forward,
            mp_policy=self.mp_policy,
            offload_policy=self.offload_policy,
            ignored_params=ignored_parameters(model, self.plugin.ignored_modules) or None,
        )
        for unit in units:
            shard(unit)
        shard(model)
        if efficient:
            model.to_empty(device="cpu" if self.plugin.cpu_offload else self.device)
            broadcast_from_main(model, full_state, buffers, self.state)
        self._record_replacements(owners)
        self.sharded_models.append(model)
        return model

    def _check_wrappable(self, model: nn.Module) -> None:
        if isinstance(model, FSDPModule):
            raise ValueError(
                f"{type(model).__name__} is already sharded with fully_shard; pass the plain model to prepare()."
            )
        if self.plugin.activation_checkpointing and getattr(model, "is_gradient_checkpointing", False):
            raise ValueError(
                f"{type(model).__name__} has gradient checkpointing switched on and the FSDP plugin sets "
                "activation_checkpointing=True: the activations would be recomputed twice. Use one of them: "
                "call model.gradient_checkpointing_disable() or set activation_checkpointing=False."
            )

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

    # -- optimizers -------------------------------------------------------------------------------
    def _record_replacements(self, owners: list[tuple[weakref.ref, nn.Module, str]]) -> None:
        for reference, module, name in owners:
            original = reference()
            if original is not None:
                self._replacements[id(original)] = (reference, module._parameters[name])  # type: ignore[assignment]

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Re-bind an optimizer built before sharding to the sharded parameters."""
        sharded = {id(p) for model in self.sharded_models for p in model.parameters()}
        for group in optimizer.param_groups:
            group["params"] = [self._sharded_parameter(p, sharded, optimizer) for p in group["params"]]
        return optimizer

    def _sharded_parameter(
        self, parameter: torch.Tensor, sharded: set[int], optimizer: torch.optim.Optimizer
    ) -> torch.Tensor:
        if id(parameter) in sharded:
            return parameter
        entry = self._replacements.get(id(parameter))
        if entry is None or entry[0]() is not parameter:
            raise ValueError(
                f"{type(optimizer).__name__} holds a parameter of shape {tuple(parameter.shape)} that belongs to no "
                "model prepared with FSDP. Prepare the model in the same (or an earlier) prepare() call, and build "
                "the optimizer from that model's parameters."
            )
        if optimizer.state.get(parameter):
            raise ValueError(
                f"{type(optimizer).__name__} has already stepped (it holds state for the unsharded parameters). "
                "Prepare the model and the optimizer before the first optimizer step."
            )
        return entry[1]

    def model_of(self, optimizer: Any) -> nn.Module | None:
        """The sharded model whose parameters ``optimizer`` updates (None when it updates none)."""
        inner = getattr(optimizer, "optimizer", optimizer)
        params = {id(p) for group in inner.param_groups for p in group["params"]}
        for model in self.sharded_models:
            if any(id(p) in params for p in model.parameters()):
                return model
        return None

    def sharded_objects(self) -> ShardedObjects:
        return ShardedObjects(
            sharded_state_dict=self.plugin.state_dict_type == "SHARDED_STATE_DICT",
            model_of=self.model_of,
            models={id(model) for model in self.sharded_models},
        )

    # -- training step ----------------------------------------------------------------------------
    def is_wrapped(self, model: nn.Module) -> bool:
        return isinstance(getattr(model, "_orig_mod", model), FSDPModule)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        target = getattr(model, "_orig_mod", model)
        if isinstance(target, FSDPModule):
            return _gradient_sync_off(target)
        return contextlib.nullcontext()

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        parameters = list(parameters)
        grads = [p.grad for p in parameters if p.grad is not None]
        total = global_grad_norm(grads, float(norm_type), self.state)
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        with torch.no_grad():
            for grad in grads:
                local = grad.to_local() if isinstance(grad, DTensor) else grad
                local.mul_(coefficient.to(device=local.device, dtype=local.dtype))
        return total

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's weights gathered on the main process (an empty dict on the others)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        target = getattr(model, "_orig_mod", model)
        if not isinstance(target, FSDPModule):
            return target.state_dict()
        return get_model_state_dict(target, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


@contextlib.contextmanager
def _gradient_sync_off(model: FSDPModule) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def global_grad_norm(grads: list[torch.Tensor], norm_type: float, state: PartialState) -> torch.Tensor:
    """The norm of all gradients together: sharded (DTensor) parts are reduced over processes, replicated
    parts (ignored modules) are counted once."""
    device = grads[0].device if grads else state.device
    sharded = [g.to_local() for g in grads if isinstance(g, DTensor)]
    replicated = [g for g in grads if not isinstance(g, DTensor)]
    if math.isinf(norm_type):
        local = torch.zeros((), device=device, dtype=torch.float32)
        for grad in sharded + replicated:
            if grad.numel():
                local = torch.maximum(local, grad.detach().abs().max().float().to(device))
        if state.use_distributed and sharded:
            dist.all_reduce(local, op=dist.ReduceOp.MAX)
        return local
    shard_sum = torch.zeros((), device=device, dtype=torch.float32)
    for grad in sharded:
        shard_sum += torch.linalg.vector_norm(grad.detach().float(), norm_type).to(device) ** norm_type
    if state.use_distributed:
        dist.all_reduce(shard_sum)
    for grad in replicated:
        shard_sum += torch.linalg.vector_norm(grad.detach().float(), norm_type).to(device) ** norm_type
    return shard_sum ** (1.0 / norm_type)


def _parameter_owners(model: nn.Module) -> list[tuple[weakref.ref, nn.Module, str]]:
    return [
        (weakref.ref(parameter), module, name)
        for module in model.modules()
        for name, parameter in module._parameters.items()
        if parameter is not None
    ]


def _checkpoint_activations(model: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """Wrap each unit in torch's activation-checkpoint wrapper; returns the wrappers (the new units)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        CheckpointWrapper,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    if not units:
        raise ValueError(
            f"FSDP activation_checkpointing=True needs layers to checkpoint, but the wrap policy selects no "
            f"submodule of {type(model).__name__}. Set auto_wrap_policy (e.g. TRANSFORMER_BASED_WRAP with "
            "transformer_cls_names_to_wrap) so that the repeated layers become units."
        )
    chosen = {id(unit) for unit in units}
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT
        ),
        check_fn=lambda module: id(module) in chosen,
    )
    wrappers = [
        m
        for m in model.modules()
        if isinstance(m, CheckpointWrapper) and id(m._checkpoint_wrapped_module) in chosen
    ]
    return wrappers[::-1]  # descendants before their ancestors, as fully_shard needs
