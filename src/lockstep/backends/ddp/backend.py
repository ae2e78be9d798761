"""Data parallel training with ``torch.nn.parallel.DistributedDataParallel``."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any, final

from torch import nn

from lockstep.backends.base import Backend
from lockstep.backends.capabilities import TrainingStateTransfer
from lockstep.backends.replicated_state import ReplicatedStateTransfer
from lockstep.config.enums import DDPCommunicationHookType
from lockstep.config.kwargs import DistributedDataParallelKwargs
from lockstep.config.plugins import TorchDynamoPlugin
from lockstep.precision import Precision
from lockstep.state import PartialState


def syncs_gradients_in_backward(model: nn.Module) -> bool:
    """Whether ``model`` is a DDP model that all-reduces its gradients in its next backward (not under
    ``no_sync``): what :mod:`lockstep.throughput.comm` times."""
    return isinstance(model, nn.parallel.DistributedDataParallel) and model.require_backward_grad_sync


def _comm_hook(
    hook_type: DDPCommunicationHookType, wrapper_type: DDPCommunicationHookType
) -> tuple[Any, bool]:
    """torch's hook for ``hook_type`` (wrapped by ``wrapper_type``), and whether it is a PowerSGD hook.
    Imported here: the hooks cost an import most runs never use."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    hooks = {
        DDPCommunicationHookType.FP16: default_hooks.fp16_compress_hook,
        DDPCommunicationHookType.BF16: default_hooks.bf16_compress_hook,
        DDPCommunicationHookType.POWER_SGD: powerSGD_hook.powerSGD_hook,
        DDPCommunicationHookType.BATCHED_POWER_SGD: powerSGD_hook.batched_powerSGD_hook,
    }
    wrappers = {
        DDPCommunicationHookType.FP16: default_hooks.fp16_compress_wrapper,
        DDPCommunicationHookType.BF16: default_hooks.bf16_compress_wrapper,
    }
    hook = hooks[hook_type]
    if wrapper_type != DDPCommunicationHookType.NO:
        hook = wrappers[wrapper_type](hook)
    power_sgd = hook_type in (DDPCommunicationHookType.POWER_SGD, DDPCommunicationHookType.BATCHED_POWER_SGD)
    return hook, power_sgd


@final
class DDPBackend(Backend):
    """Replicate the model on every process and all-reduce gradients in backward.

    Args:
        state: the process state.
        precision: the mixed-precision setting (autocast forward, fp16 gradient scaling).
        ddp_kwargs: the user's ``DistributedDataParallelKwargs``; None means torch's defaults.
        dynamo_plugin: ``torch.compile`` settings (the model is compiled *before* the DDP wrap, because
            ``torch.compile(DDP(m))`` silently runs eager).
    """

    capability_objects = {TrainingStateTransfer: ReplicatedStateTransfer}

    def __init__(
        self,
        state: PartialState,
        *,
        precision: Precision,
        ddp_kwargs: DistributedDataParallelKwargs | None = None,
        dynamo_plugin: TorchDynamoPlugin | None = None,
    ) -> None:
        super().__init__(state, precision=precision, dynamo_plugin=dynamo_plugin)
        self.explicit_kwargs = ddp_kwargs is not None
        self.ddp_kwargs = ddp_kwargs or DistributedDataParallelKwargs()
        self.distributed_type = state.distributed_type

    def wrap_model(self, model: nn.Module) -> nn.Module:
        if not any(p.requires_grad for p in model.parameters()):
            if self.explicit_kwargs:
                raise ValueError(
                    f"Cannot prepare {type(model).__name__} for DistributedDataParallel with "
                    "DistributedDataParallelKwargs: none of its parameters requires grad, so there is nothing "
                    "to synchronise. Unfreeze some parameters, or prepare it with evaluation_mode=True."
                )
            return model  # a frozen model (e.g. a teacher) needs no gradient synchronisation
        device_ids = [self.device.index] if self.device.type in ("cuda", "xpu") else None
        with warnings.catch_warnings():
            # broadcast_buffers=False keeps Accelerate's meaning (no buffer sync at all); torch 2.13 warns
            # that the argument is deprecated, which is ours to handle, not the user's
            # (docs/torch-notes.md, "Deprecated DDP argument").
            warnings.filterwarnings(
                "ignore", message=".*broadcast_buffers. is deprecated", category=FutureWarning
            )
            wrapped = nn.parallel.DistributedDataParallel(
                model,
                device_ids=device_ids,
                output_device=device_ids[0] if device_ids else None,
                **self.ddp_kwargs.ddp_constructor_kwargs(),
            )
        self._register_comm_hook(wrapped)
        return wrapped

    def _register_comm_hook(self, model: nn.parallel.DistributedDataParallel) -> None:
        hook_type, wrapper_type = self.ddp_kwargs.comm_hook, self.ddp_kwargs.comm_wrapper
        if hook_type == DDPCommunicationHookType.NO:
            return
        hook, power_sgd = _comm_hook(hook_type, wrapper_type)
        state: Any = None
        if power_sgd:
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

            state = powerSGD_hook.PowerSGDState(process_group=None, **self.ddp_kwargs.comm_state_option)
        model.register_comm_hook(state, hook)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            return model.no_sync()
        return contextlib.nullcontext()

    def sync_next_backward(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Make DDP all-reduce in the next backward even under ``no_sync`` (Accelerate's approach): the
        reducer is prepared for a backward whose forward ran without it. Every parameter must receive a
        gradient in that backward (the reducer is told of no unused parameters)."""
        if not isinstance(model, nn.parallel.DistributedDataParallel):
            return contextlib.nullcontext()
        if model.find_unused_parameters:
            raise ValueError(
                "trigger_sync_in_backward() cannot synchronise a DDP model built with "
                "DistributedDataParallelKwargs(find_unused_parameters=True): its forward ran under no_sync, so "
                "DDP never searched the graph for parameters without a gradient. Let accumulate() synchronise "
                "that step instead, or set find_unused_parameters=False."
            )
        return _forced_sync(model)


@contextlib.contextmanager
def _forced_sync(model: nn.parallel.DistributedDataParallel) -> Iterator[None]:
    backward_sync, forward_sync = model.require_backward_grad_sync, model.require_forward_param_sync
    model.require_backward_grad_sync = True
    model.require_forward_param_sync = True
    # A forward under no_sync did not call prepare_for_backward, so the reducer would ignore this backward;
    # see torch/nn/parallel/distributed.py (_pre_forward) and reducer.cpp (prepare_for_backward).
    model.reducer.prepare_for_backward([])
    try:
        yield
    finally:
        model.require_backward_grad_sync = backward_sync
        model.require_forward_param_sync = forward_sync
