"""The interface every way of distributing a model implements.

A backend answers: how to wrap a model (and its optimizers) for this topology, how to skip gradient
synchronisation, how to clip gradients, and how to get the user's model back. The Accelerator calls
these methods and never asks which backend it has; only :mod:`lockstep.backends.registry` chooses.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch
from torch import nn

from lockstep.checkpoint.sharded import ShardedObjects
from lockstep.config.enums import DistributedType
from lockstep.config.plugins import TorchDynamoPlugin
from lockstep.state import PartialState


class Backend(ABC):
    """How models are placed, wrapped and synchronised.

    Args:
        state: the process state (rank, world size, device).
        dynamo_plugin: ``torch.compile`` settings, applied before any distributed wrapper.
    """

    distributed_type: DistributedType

    def __init__(self, state: PartialState, *, dynamo_plugin: TorchDynamoPlugin | None = None) -> None:
        self.state = state
        self.dynamo_plugin = dynamo_plugin

    @property
    def device(self) -> torch.device:
        return self.state.device

    def prepare_model(
        self, model: nn.Module, *, device_placement: bool, evaluation_mode: bool = False
    ) -> nn.Module:
        """Place, compile and wrap ``model``; returns the module the user trains."""
        if device_placement:
            model = model.to(self.device)
        if self.dynamo_plugin is not None and self.dynamo_plugin.enabled:
            model = torch.compile(model, **self.dynamo_plugin.compile_kwargs())  # type: ignore[assignment]
        if evaluation_mode:
            return model
        return self.wrap_model(model)

    @abstractmethod
    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Apply this backend's distributed wrapper to a placed (and maybe compiled) model."""

    def is_wrapped(self, model: nn.Module) -> bool:
        """Whether ``model`` carries this backend's wrapper."""
        return False

    def unwrap_model(self, model: nn.Module, *, keep_torch_compile: bool = True) -> nn.Module:
        """Strip distributed wrappers (and the ``torch.compile`` wrapper unless kept)."""
        while True:
            if isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
                model = model.module
            elif not keep_torch_compile and isinstance(getattr(model, "_orig_mod", None), nn.Module):
                model = model._orig_mod
            else:
                return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Adapt an optimizer to the wrapped models (FSDP re-binds it to the sharded parameters)."""
        return optimizer

    def model_of(self, optimizer: object) -> nn.Module | None:
        """The sharded model an optimizer updates, for backends whose checkpoints need it (else None)."""
        return None

    def sharded_objects(self) -> ShardedObjects | None:
        """How sharded models and their optimizers are checkpointed (None: this backend shards nothing)."""
        return None

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole (unwrapped) model's weights; sharding backends gather them on the main process."""
        return model.state_dict()

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """A context in which backward passes do not synchronise gradients."""
        return contextlib.nullcontext()

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip the global gradient norm; returns the norm before clipping."""
        return nn.utils.clip_grad_norm_(list(parameters), max_norm, norm_type=norm_type)
