"""What every backend that shards with FSDP2 (``torch.distributed.fsdp.fully_shard``) shares.

:class:`ShardedBackend` is the abstract base of the FSDP, N-D and pipeline backends. It holds the sharding
settings (the plugin, the ``MixedPrecisionPolicy`` derived from the precision, the offload policy), shards
a model's units over the mesh a subclass names (:attr:`ShardedBackend.mesh`), remembers which sharded
parameter replaced which original one so that optimizers built before sharding are re-bound to them, and
implements the parts of the backend interface that only depend on the models being FSDP/DTensor-sharded:
gradient sync switch, global-norm clipping (:mod:`.clipping`), full state dicts and checkpoints
(:mod:`.checkpoint`). Each concrete backend adds how it places and cuts the model, and over which mesh.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from abc import abstractmethod
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard

from lockstep.backends.base import Backend, Indexed
from lockstep.backends.capabilities import GatheredForward, SeparateSharding, ShardedCheckpointIO
from lockstep.backends.fsdp import checkpoint as shards
from lockstep.backends.fsdp.clipping import clip_sharded_gradients
from lockstep.backends.fsdp.loading import announce_main_process_loading
from lockstep.backends.fsdp.plugin import FullyShardedDataParallelPlugin
from lockstep.backends.fsdp.precision import FSDPPrecision
from lockstep.backends.fsdp.units import checkpoint_activations, ignored_parameters, select_units
from lockstep.checkpoint.training_state import GivenState
from lockstep.collectives import broadcast_object_list
from lockstep.config.plugins import TorchDynamoPlugin
from lockstep.integrations.peft import guard_sharded
from lockstep.state import PartialState

checkpoint_logger = logging.getLogger("lockstep.checkpoint")


class ShardedBackend(Backend, ShardedCheckpointIO, GatheredForward, SeparateSharding):
    """The sharding state and the FSDP2 parts of the backend interface; abstract: a subclass says over which
    mesh it shards (:attr:`mesh`) and how it wraps a model (:meth:`wrap_model`).

    Args:
        state: the process state.
        plugin: the FSDP settings.
        precision: the Accelerator's mixed precision; it wraps the forward in autocast like every backend's
            and becomes the ``MixedPrecisionPolicy`` unless the plugin sets one.
        dynamo_plugin: ``torch.compile`` settings.
    """

    def __init__(
        self,
        state: PartialState,
        *,
        plugin: FullyShardedDataParallelPlugin,
        precision: FSDPPrecision,
        dynamo_plugin: TorchDynamoPlugin | None = None,
    ) -> None:
        super().__init__(state, precision=precision, dynamo_plugin=dynamo_plugin)
        self.plugin = plugin
        self.mp_policy = precision.policy(plugin.mixed_precision_policy)
        # Pinned memory needs an accelerator; on a CPU-only machine the offload path runs unpinned.
        pinned = self.device.type != "cpu"
        self.offload_policy: OffloadPolicy = (
            CPUOffloadPolicy(pin_memory=pinned) if plugin.cpu_offload else OffloadPolicy()
        )
        self.sharded_models: list[nn.Module] = []
        # id(original parameter) -> (weak reference to it, the sharded parameter that replaced it)
        self._replacements: dict[int, tuple[weakref.ref, nn.Parameter]] = {}
        # sharded model -> whether its gradients are synchronised now (absent: yes); FSDP2 has no getter
        self._sync_enabled: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()
        if plugin.cpu_ram_efficient_loading:
            announce_main_process_loading()

    @property
    @abstractmethod
    def mesh(self) -> DeviceMesh | None:
        """The mesh ``fully_shard`` shards over; None when the layout has no dimension to shard over (tensor
        or pipeline parallelism alone), so that nothing is sharded."""

    # -- models -----------------------------------------------------------------------------------
    def _prepare_for_training(self, model: nn.Module, *, device_placement: bool) -> nn.Module:
        return self._compiled(self.wrap_model(model, device_placement=device_placement))

    @abstractmethod
    def wrap_model(self, model: nn.Module, *, device_placement: bool = True) -> nn.Module:
        """Place (when asked), split and shard ``model``; record it in :attr:`sharded_models` and its
        parameters' replacements (:meth:`_record_replacements`)."""

    def _shard(self, model: nn.Module, mesh: DeviceMesh) -> None:
        """Apply ``fully_shard`` over ``mesh`` to the plugin's units (activation-checkpointed when asked),
        then to the whole model."""
        units = select_units(model, self.plugin)
        if self.plugin.activation_checkpointing:
            units = checkpoint_activations(model, units, self.plugin)
        shard = functools.partial(
            fully_shard,
            mesh=mesh,
            reshard_after_forward=self.plugin.reshard_after_forward,
            mp_policy=self.mp_policy,
            offload_policy=self.offload_policy,
            ignored_params=ignored_parameters(model, self.plugin.ignored_modules) or None,
        )
        for unit in units:
            shard(unit)
        shard(model)
        guard_sharded(model, "FSDP2")

    def shard_apart(
        self, module: nn.Module, mesh: DeviceMesh, *, replaced: Mapping[str, nn.Parameter] | None = None
    ) -> None:
        """``fully_shard`` ``module`` over ``mesh`` with this backend's settings, before :meth:`wrap_model`
        shards the model around it (:class:`~lockstep.backends.capabilities.SeparateSharding`)."""
        fully_shard(
            module,
            mesh=mesh,
            reshard_after_forward=self.plugin.reshard_after_forward,
            mp_policy=self.mp_policy,
            offload_policy=self.offload_policy,
        )
        for name, original in (replaced or {}).items():
            self._replacements[id(original)] = (weakref.ref(original), module.get_parameter(name))

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

    def _is_sharded(self, model: nn.Module) -> bool:
        return any(model is m or getattr(model, "_orig_mod", None) is m for m in self.sharded_models)

    # -- training step ----------------------------------------------------------------------------
    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return self._gradient_sync(model, False)

    def sync_next_backward(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Reduce-scatter the gradients of the next backward (with those accumulated under ``no_sync``)."""
        return self._gradient_sync(model, True)

    def _gradient_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        target = getattr(model, "_orig_mod", model)
        if isinstance(target, FSDPModule):
            return _gradient_sync_set(target, enabled, self._sync_enabled)
        return contextlib.nullcontext()

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        return clip_sharded_gradients(list(parameters), max_norm, norm_type, self.state)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's weights gathered on the main process (an empty dict on the others)."""
        target = getattr(model, "_orig_mod", model)
        if not isinstance(target, FSDPModule):
            return target.state_dict()
        return gathered_state_dict(target)

    # -- parameters gathered in forward ----------------------------------------------------------------
    def gathers_in_forward(self, model: nn.Module) -> bool:
        """Whether ``fully_shard`` sharded ``model`` or a submodule: each forward gathers their parameters."""
        return any(isinstance(module, FSDPModule) for module in model.modules())

    @contextlib.contextmanager
    def root_parameters_gathered(self, model: nn.Module) -> Iterator[None]:
        """The parameters that FSDP2 shards with the root module (embeddings, often) gathered meanwhile; the
        inner ``fully_shard`` blocks gather as they run."""
        if not isinstance(model, FSDPModule):
            yield
            return
        model.unshard()
        try:
            yield
        finally:
            model.reshard()

    # -- checkpoints ------------------------------------------------------------------------------
    @property
    def _writes_shards(self) -> bool:
        """SHARDED_STATE_DICT: every process writes its own DCP shards (else one full copy on the main one)."""
        return self.plugin.state_dict_type == "SHARDED_STATE_DICT"

    def model_state_dicts(self, models: Sequence[nn.Module]) -> list[dict[str, torch.Tensor] | None]:
        return [
            None
            if self._writes_shards and self._is_sharded(model)
            else self.full_state_dict(self.unwrap_model(model, keep_torch_compile=False))
            for model in models
        ]

    def optimizer_states(self, optimizers: Sequence[Any]) -> list[Any]:
        states: list[Any] = []
        for optimizer in optimizers:
            model = self.model_of(optimizer)
            if model is None:
                states.append(optimizer)
            elif self._writes_shards:
                states.append(None)
            else:  # FULL_STATE_DICT gathers the whole state on the main process (a collective)
                states.append(GivenState(shards.full_optimizer_state(model, optimizer)))
        return states

    def pending_gradients(
        self, models: Sequence[nn.Module], *, mid_accumulation: bool
    ) -> dict[str, torch.Tensor]:
        if mid_accumulation and any(self._is_sharded(model) for model in models):
            checkpoint_logger.warning(
                "save_state in the middle of a gradient accumulation cycle with FSDP: the gradients of the "
                "micro-batches so far live inside FSDP and are not saved; save after an optimizer step."
            )
        return super().pending_gradients(models, mid_accumulation=mid_accumulation)

    def _holds_own_gradients(self, model: nn.Module) -> bool:
        return not self._is_sharded(model)

    def _split(self, models: Indexed, optimizers: Indexed) -> tuple[Indexed, Indexed, Indexed, Indexed]:
        """(sharded models, their optimizers as (index, model, optimizer), other models, other optimizers)."""
        sharded_models = [(i, m) for i, m in models if self._is_sharded(m)]
        pairs = [(i, self.model_of(o), o) for i, o in optimizers]
        sharded_optimizers = [(i, model, o) for i, model, o in pairs if model is not None]
        other_models = [(i, m) for i, m in models if not self._is_sharded(m)]
        other_optimizers = [(i, o) for i, model, o in pairs if model is None]
        return sharded_models, sharded_optimizers, other_models, other_optimizers

    def save_shards(
        self, models: Indexed, optimizers: Indexed, folder: Path, *, frozen_left_out: Collection[int] = ()
    ) -> None:
        if self._writes_shards:  # DCP is a collective: every process writes its own shards now, in parallel
            sharded_models, sharded_optimizers, _, _ = self._split(models, optimizers)
            shards.save_sharded(sharded_models, sharded_optimizers, folder, frozen_left_out=frozen_left_out)

    def read_model_states(self, models: Indexed, optimizers: Indexed, folder: Path) -> Any:
        """Restore the models and optimizers FSDP does not shard; the main process finds how the sharded ones
        are stored (shards, or whole state dicts it reads now), whatever ``state_dict_type`` is set."""
        sharded_models, sharded_optimizers, other_models, other_optimizers = self._split(models, optimizers)
        super().read_model_states(other_models, other_optimizers, folder)
        if not self.state.is_main_process:
            return shards.FolderContents(folder)
        return shards.read_contents(
            folder, [i for i, _ in sharded_models], [i for i, _, _ in sharded_optimizers]
        )

    def apply_model_states(self, models: Indexed, optimizers: Indexed, loaded: Any) -> None:
        sharded_models, sharded_optimizers, _, _ = self._split(models, optimizers)
        if not (sharded_models or sharded_optimizers):
            return
        contents: shards.FolderContents = loaded
        if self.state.use_distributed:  # how each one is stored, as the main process found it
            kinds = broadcast_object_list([(contents.models, contents.optimizers)], from_process=0)[0]
            contents.models, contents.optimizers = kinds
        shards.load_contents(
            contents, sharded_models, sharded_optimizers, distributed=self.state.use_distributed
        )


@contextlib.contextmanager
def _gradient_sync_set(
    model: FSDPModule, enabled: bool, current: weakref.WeakKeyDictionary[nn.Module, bool]
) -> Iterator[None]:
    """Switch ``model``'s gradient synchronisation for the block, then restore what it was (``current``
    holds each model's setting, since nested blocks may switch it both ways)."""
    key: nn.Module = model  # type: ignore[assignment]
    previous = current.get(key, True)
    model.set_requires_gradient_sync(enabled)
    current[key] = enabled
    try:
        yield
    finally:
        model.set_requires_gradient_sync(previous)
        current[key] = previous


def parameter_owners(model: nn.Module) -> list[tuple[weakref.ref, nn.Module, str]]:
    """(weak reference to each parameter, the module holding it, its name there): taken before sharding, to
    find the sharded parameter that replaced each one (:meth:`ShardedBackend._record_replacements`)."""
    return [
        (weakref.ref(parameter), module, name)
        for module in model.modules()
        for name, parameter in module._parameters.items()
        if parameter is not None
    ]


def gathered_state_dict(model: nn.Module) -> dict[str, Any]:
    """The whole model's weights gathered on the main process (in CPU memory), whether FSDP, tensor
    parallelism or both split them; an empty dict on the other processes."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
