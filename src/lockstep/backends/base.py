"""The interface every way of distributing a model implements.

A backend is the one place that knows its strategy. It answers:

* **models and optimizers**: place, compile and wrap a model (:meth:`Backend.prepare_model`); adapt an
  optimizer to the wrapped model (:meth:`Backend.prepare_optimizer`); give the user's module back;
* **precision**: it owns its :class:`~lockstep.precision.Precision` (the forward autocast context, the fp16
  gradient scaler, :meth:`Backend.backward`); a sharding backend derives its own policy from the same object;
* **gradient synchronisation**: :meth:`Backend.no_sync` (used by ``accumulate()``) and its exception
  :meth:`Backend.sync_next_backward` (``trigger_sync_in_backward``), :meth:`Backend.clip_grad_norm_`;
* **checkpoints**: which model and optimizer state goes into a checkpoint folder and how it comes back
  (full state dicts written as ordinary files by default; a sharding backend writes its own shards).

The Accelerator and :mod:`lockstep.checkpoint` call these methods and never ask which backend they have;
only :mod:`lockstep.backends.registry` chooses. What only some backends can do (joint preparation, pipeline
schedules, context parallelism, sharded checkpoint I/O, live state transfer) is not a method here: it is a
capability (:mod:`lockstep.backends.capabilities`) that :meth:`Backend.capability` hands out.
"""

from __future__ import annotations

import contextlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn

from lockstep.backends.capabilities import C, Indexed
from lockstep.config.enums import DistributedType
from lockstep.config.plugins import TorchDynamoPlugin
from lockstep.precision import Precision
from lockstep.state import PartialState

logger = logging.getLogger("lockstep.backends")


class DataShard(NamedTuple):
    """Which share of the data a process reads: replica ``index`` of ``count`` data-parallel replicas."""

    index: int
    count: int
    place_batches: bool = True
    """Move this process's batches to its device (False: it uses none of them, e.g. a middle pipeline stage)."""


def _compiled_like(compiled: nn.Module, module: nn.Module) -> nn.Module:
    """A ``torch.compile`` wrapper around ``module`` with ``compiled``'s compile settings."""
    return type(compiled)(module, compiled.dynamo_ctx)  # type: ignore[call-arg, attr-defined]


class Backend(ABC):
    """How models are placed, wrapped, synchronised and checkpointed.

    Args:
        state: the process state (rank, world size, device).
        precision: the mixed-precision setting this backend trains with.
        dynamo_plugin: ``torch.compile`` settings.
    """

    distributed_type: DistributedType
    capability_objects: ClassVar[dict[type, Callable[[Backend], Any]]] = {}
    """Capabilities this backend hands out as small objects built around it (``kind -> factory(backend)``),
    beside those it implements itself (the capability interfaces among its bases)."""

    def __init__(
        self,
        state: PartialState,
        *,
        precision: Precision,
        dynamo_plugin: TorchDynamoPlugin | None = None,
    ) -> None:
        self.state = state
        self.precision = precision
        self.dynamo_plugin = dynamo_plugin

    @property
    def device(self) -> torch.device:
        return self.state.device

    def capability(self, kind: type[C]) -> C | None:
        """The object that does ``kind`` for this backend (see :mod:`lockstep.backends.capabilities`), or
        None when this backend cannot.

        Example:
            >>> from lockstep.backends.capabilities import PipelineSchedule
            >>> from lockstep.backends.registry import select_backend
            >>> from lockstep.state import PartialState
            >>> select_backend(PartialState(cpu=True)).capability(PipelineSchedule) is None
            True
        """
        factory = self.capability_objects.get(kind)
        if factory is not None:
            return factory(self)  # type: ignore[return-value]
        return self if isinstance(self, kind) else None

    def data_shard(self) -> DataShard:
        """The share of each dataloader this process reads: every process its own, unless processes hold
        parts of one model replica (tensor parallelism), which then read the same batches."""
        return DataShard(index=self.state.process_index, count=self.state.num_processes)

    def data_parallel_group(self) -> Any:
        """The ``ProcessGroup`` of the data-parallel replicas this process belongs to, which metrics are
        gathered and reduced over so that each sample counts once; None: every process (the default)."""
        return None

    # -- models and optimizers --------------------------------------------------------------------
    def prepare_model(
        self, model: nn.Module, *, device_placement: bool, evaluation_mode: bool = False
    ) -> nn.Module:
        """Run the forward pass in this backend's precision, then place, compile and wrap ``model``.

        Args:
            model: the user's module.
            device_placement: move it to this process's device.
            evaluation_mode: skip the distributed wrapper (a model that is never trained).

        Returns:
            The module the user trains.
        """
        self.precision.wrap_forward(model)
        if evaluation_mode:
            return self._compiled(self._placed(model, device_placement))
        return self._prepare_for_training(model, device_placement=device_placement)

    def _prepare_for_training(self, model: nn.Module, *, device_placement: bool) -> nn.Module:
        # Compiled before the distributed wrapper: torch.compile(DDP(m)) silently runs eager
        # (docs/torch-notes.md, "torch.compile").
        return self.wrap_model(self._compiled(self._placed(model, device_placement)))

    def _placed(self, model: nn.Module, device_placement: bool) -> nn.Module:
        return model.to(self.device) if device_placement else model

    def _compiled(self, model: nn.Module) -> nn.Module:
        plugin = self.dynamo_plugin
        if plugin is None or not plugin.enabled:
            return model
        if plugin.use_regional_compilation:
            from lockstep.integrations.regional_compilation import compile_regions_in_place

            # In place (nn.Module.compile on each repeated block): the prepared model keeps its identity,
            # parameter names and forward wrapper, and a sharding backend's hooks keep running.
            return compile_regions_in_place(model, **plugin.compile_kwargs())
        return torch.compile(model, **plugin.compile_kwargs())  # type: ignore[return-value]

    @abstractmethod
    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Apply this backend's distributed wrapper to a placed (and maybe compiled) model."""

    def unwrap_model(self, model: nn.Module, *, keep_torch_compile: bool = True) -> nn.Module:
        """Strip distributed wrappers (and the ``torch.compile`` wrapper unless kept).

        A model compiled *around* its distributed wrapper (``torch.compile(prepared)``) comes back, with
        ``keep_torch_compile``, as a compiled module around the unwrapped model, as in Accelerate. Unlike
        Accelerate, the training model is left as it is (Accelerate re-points its ``_orig_mod``, so the
        compiled model it trains stops synchronising gradients); a new compiled wrapper is returned.
        """
        while True:
            if isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
                model = model.module
            elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
                inner = self.unwrap_model(model._orig_mod, keep_torch_compile=keep_torch_compile)
                if not keep_torch_compile:
                    return inner
                if inner is model._orig_mod or not isinstance(
                    model, torch._dynamo.eval_frame.OptimizedModule
                ):
                    return model  # the same model inside, or a compile_regions copy (not re-wrappable)
                return _compiled_like(model, inner)
            else:
                return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Adapt an optimizer to the wrapped models (FSDP re-binds it to the sharded parameters)."""
        return optimizer

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole (unwrapped) model's weights; sharding backends gather them on the main process."""
        return model.state_dict()

    # -- training step ----------------------------------------------------------------------------
    def scale_for_accumulation(self, loss: torch.Tensor, steps: int) -> torch.Tensor:
        """The loss of one micro-batch of ``steps``, as backward should see it (divided by ``steps``)."""
        return loss / steps if steps > 1 else loss

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` in this backend's precision (scaled under fp16)."""
        self.precision.backward(loss, **kwargs)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """A context in which backward passes do not synchronise gradients."""
        return contextlib.nullcontext()

    def sync_next_backward(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """A context in which a backward pass synchronises gradients even inside :meth:`no_sync` (including
        one whose forward ran there); a no-op for a backend that never skips synchronisation."""
        return contextlib.nullcontext()

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip the global gradient norm; returns the norm before clipping."""
        return nn.utils.clip_grad_norm_(list(parameters), max_norm, norm_type=norm_type)

    # -- checkpoints: saving ------------------------------------------------------------------------
    def model_state_dicts(self, models: Sequence[nn.Module]) -> list[dict[str, torch.Tensor] | None]:
        """Each model's weights for the checkpoint's model files (written by the main process), or None for
        a model this backend writes itself in :meth:`save_shards`. Called on every rank together."""
        return [self.full_state_dict(self.unwrap_model(m, keep_torch_compile=False)) for m in models]

    def optimizer_states(self, optimizers: Sequence[Any]) -> list[Any]:
        """What becomes each ``optimizer_N.bin``: an object whose ``state_dict()`` the main process takes
        while it snapshots (the optimizer itself here; a ``GivenState`` for state gathered beforehand), or
        None for an optimizer this backend writes itself. Called on every rank together, so it may gather."""
        return list(optimizers)

    def pending_gradients(
        self, models: Sequence[nn.Module], *, mid_accumulation: bool
    ) -> dict[str, torch.Tensor]:
        """This rank's gradients accumulated so far, as CPU copies keyed ``"<model index>.<parameter>"``.

        Args:
            models: the prepared models.
            mid_accumulation: the save happens between two optimizer steps of an accumulation cycle.
        """
        return {
            f"{index}.{name}": parameter.grad.detach().to("cpu", copy=True).contiguous()
            for index, model in enumerate(models)
            if self._holds_own_gradients(model)
            for name, parameter in self.unwrap_model(model, keep_torch_compile=False).named_parameters()
            if parameter.grad is not None
        }

    def _holds_own_gradients(self, model: nn.Module) -> bool:
        """Whether ``model``'s pending gradients are plain ``.grad`` tensors that a checkpoint can carry."""
        return True

    # -- checkpoints: loading -----------------------------------------------------------------------
    def read_model_states(self, models: Indexed, optimizers: Indexed, folder: Path) -> Any:
        """Read this process's files and restore what needs no communication; the result goes to
        :meth:`apply_model_states`. Runs inside the checkpoint's error agreement, so a missing or bad file
        on one rank is raised on every rank."""
        from lockstep.backends import from_shards  # checkpoints load on first use
        from lockstep.checkpoint.frozen_base import saved_without_frozen
        from lockstep.checkpoint.model_files import load_model_weights
        from lockstep.checkpoint.training_state import find_model_weights, load_each, model_location

        plain = {index: self.unwrap_model(model, keep_torch_compile=False) for index, model in models}
        for index, model in plain.items():
            shards = from_shards.model_shards(folder, index)
            adapter_only = saved_without_frozen(folder, index)  # keys checked before (load_state)
            if find_model_weights(folder, index) is None and shards is not None:  # saved by FSDP or pp
                from_shards.load_model(model, shards, frozen_left_out=adapter_only)
            else:
                load_model_weights(model, model_location(folder, index), strict=not adapter_only)
        whole = [(index, o) for index, o in optimizers if not _sharded_only(folder, index)]
        load_each(whole, folder, "optimizer", ".bin")
        for index, optimizer in optimizers:
            if _sharded_only(folder, index):
                model = _owner(plain.values(), optimizer)
                from_shards.load_optimizer(
                    model, optimizer, folder / from_shards.OPTIMIZER_FOLDER.format(index=index)
                )
        return None

    def restore_gradients(self, models: Sequence[nn.Module], gradients: dict[str, torch.Tensor]) -> None:
        """Put saved pending gradients back (parameters without a saved gradient get none)."""
        for index, model in enumerate(models):
            if not self._holds_own_gradients(model):
                continue
            for name, parameter in self.unwrap_model(model, keep_torch_compile=False).named_parameters():
                saved = gradients.get(f"{index}.{name}")
                parameter.grad = None if saved is None else saved.to(self.device, dtype=parameter.dtype)


def _sharded_only(folder: Path, index: int) -> bool:
    """Optimizer ``index`` was saved as shards (FSDP, pipeline parallelism) and not as ``optimizer_N.bin``."""
    from lockstep.backends.from_shards import optimizer_shards
    from lockstep.checkpoint.training_state import indexed

    return (
        not (folder / indexed("optimizer", index, ".bin")).is_file()
        and optimizer_shards(folder, index) is not None
    )


def _owner(models: Iterable[nn.Module], optimizer: Any) -> nn.Module:
    """The model whose parameters ``optimizer`` updates (sharded optimizer state is keyed by their names)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    params = {id(p) for group in inner.param_groups for p in group["params"]}
    for model in models:
        if any(id(p) in params for p in model.parameters()):
            return model
    raise ValueError(
        "The checkpoint holds an optimizer's state keyed by parameter names, but the optimizer updates "
        "parameters of no prepared model: prepare the model together with its optimizer."
    )
