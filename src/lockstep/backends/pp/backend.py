"""The pipeline backend: the model cut into stages over ``pp``, each stage FSDP-sharded over ``dp_shard``.

torchtitan's recipe on torch's own pieces: ``prepare`` traces the model once with an example micro-batch
(``torch.distributed.pipelining.pipeline``), cuts it at the split points (:mod:`.split`), keeps this
rank's stages, shards each with ``fully_shard`` over ``dp_shard`` when there is one, wraps them in
``PipelineStage`` objects on the ``pp`` process group, and returns a :class:`~.model.PipelinedModel`
that holds them under the model's own parameter names and runs torch's schedule
(``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ...).

Everything else is every sharding backend's (:class:`~lockstep.backends.fsdp.sharded.ShardedBackend`,
with the mesh read by :mod:`lockstep.backends.nd.mesh`), because the pipelined model looks like an
ordinary module:
optimizers built before ``prepare`` are re-bound to this rank's (sharded) parameters and forget those
other ranks hold; ``save_state`` writes every rank's stages into one ``torch.distributed.checkpoint``
folder (stages have disjoint names); clipping reduces the norm over the ``dp_shard`` shards, then over
the pipeline ranks; ``get_state_dict`` gathers every stage on the main process. A checkpoint saved
without pipelining (``model.safetensors``, ``optimizer.bin``) loads too: every rank reads the whole files
and keeps its stages' entries (:mod:`.full_load`); the reverse, a pp checkpoint loaded by one process or
DDP, is :mod:`lockstep.backends.from_shards`.

A model built on the meta device is traced on it, and each rank gives memory to its own stages only
(:mod:`.meta_init`); optimizers built before ``prepare`` on the meta parameters are re-bound to them too.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Iterable
from contextlib import nullcontext
from pathlib import Path
from typing import Any, final

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from lockstep.backends.base import Backend, DataShard, Indexed
from lockstep.backends.capabilities import PipelineSchedule
from lockstep.backends.fsdp import checkpoint as shards
from lockstep.backends.fsdp.clipping import global_grad_norm, scale_to_max_norm
from lockstep.backends.fsdp.plugin import FullyShardedDataParallelPlugin
from lockstep.backends.fsdp.precision import FSDPPrecision
from lockstep.backends.fsdp.sharded import ShardedBackend, gathered_state_dict, parameter_owners
from lockstep.backends.nd.mesh import MeshLayout, sum_reductions_on_gloo
from lockstep.backends.pp import full_load
from lockstep.backends.pp.meta_init import has_meta_tensors, materialise, meta_stand_ins, put_back
from lockstep.backends.pp.model import PipelinedModel
from lockstep.backends.pp.modes import (
    BufferKeepingStage,
    copy_modes,
    follow_module_modes,
    traced_in_training,
    training_only_suspects,
)
from lockstep.backends.pp.split import first_microbatch, resolve_split_points, stage_indices, trace_stages
from lockstep.config.parallelism import ParallelismConfig
from lockstep.config.pipeline import TorchPipelineParallelConfig
from lockstep.config.plugins import TorchDynamoPlugin
from lockstep.state import PartialState


@final
class PipelineBackend(ShardedBackend, PipelineSchedule):
    """Pipeline parallelism over ``pp`` (with FSDP2 over ``dp_shard`` inside each stage).

    Args:
        state: the process state.
        config: the layout (``pp_size > 1``); its mesh is built already.
        plugin: FSDP settings for the ``dp_shard`` dimension.
        precision: the Accelerator's mixed precision: bf16 autocast inside each stage (fp16 is refused).
        dynamo_plugin: ``torch.compile`` settings (not built with pipelining yet).
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
        self.config = config
        self.distributed_type = self.layout.distributed_type
        assert config.pp_handler is not None
        self.handler: TorchPipelineParallelConfig = config.pp_handler
        if precision.scaler is not None:
            raise NotImplementedError(
                f"mixed_precision='fp16' with pipeline parallelism (pp_size={config.pp_size}) is not built yet: "
                "its gradient scaler would have to skip or take a step on every stage together (one stage's "
                "overflow must stop all). Use mixed_precision='bf16', which needs no scaler, or 'no'."
            )
        if dynamo_plugin is not None and dynamo_plugin.enabled:
            raise NotImplementedError(
                "torch.compile (dynamo_backend / TorchDynamoPlugin) with pipeline parallelism is not built yet: "
                "the traced stages are not compiled. Drop the dynamo setting."
            )
        self._elsewhere: set[int] = set()
        """ids of the user's parameters that other pipeline ranks hold (dropped from optimizers)."""
        self._names: dict[int, str] = {}
        """The user's parameters' names by id (to read an ``optimizer.bin`` saved without pipelining)."""
        self._optimizer_names: weakref.WeakKeyDictionary[Any, list[list[str]]] = weakref.WeakKeyDictionary()

    @property
    def mesh(self) -> DeviceMesh | None:
        """The mesh each stage is sharded over (:attr:`MeshLayout.fsdp_mesh`): ``dp_shard``, if any."""
        return self.layout.fsdp_mesh

    @property
    def pp_mesh(self) -> DeviceMesh:
        return self.config.get_submesh("pp")

    def data_shard(self) -> DataShard:
        """The data-parallel replica's share, as every rank of a pipeline iterates it (see
        docs/how-to/pipeline-parallel.md for why); ranks holding neither the first nor the last stage use no
        batch, so their batches stay where the loader made them (no copy to the device)."""
        handler, pp_size = self.handler, self.config.pp_size
        num_stages = pp_size * handler.stages_per_rank  # type: ignore[operator]
        held = stage_indices(
            self.pp_mesh.get_local_rank(), pp_size, handler.stages_per_rank, handler.stage_layout
        )  # type: ignore[arg-type]
        uses = 0 in held or num_stages - 1 in held
        return self.layout.data_shard()._replace(place_batches=uses)

    def data_parallel_group(self) -> dist.ProcessGroup | None:
        """The ``dp`` replicas only: the ranks of one pipeline read the same batch (and, after an evaluation
        forward, hold the same outputs), so metrics gathered over every process would count them ``pp_size``
        times."""
        return self.layout.replica_group()

    # -- models -----------------------------------------------------------------------------------
    def prepare_model(
        self, model: nn.Module, *, device_placement: bool, evaluation_mode: bool = False
    ) -> nn.Module:
        if evaluation_mode:
            raise NotImplementedError(
                "prepare_model(evaluation_mode=True) with pipeline parallelism is not built yet. For pipelined "
                "inference, call lockstep.prepare_pippy(model, example_args=...) (one stage per process, no "
                "pp_size needed); or prepare the model for training and evaluate it in eval() mode."
            )
        return self.wrap_model(model, device_placement=device_placement)

    def wrap_model(self, model: nn.Module, *, device_placement: bool = True) -> nn.Module:
        if isinstance(model, PipelinedModel):
            raise ValueError("This model is pipelined already; pass the plain model to prepare().")
        handler, pp_size = self.handler, self.config.pp_size
        num_stages = pp_size * handler.stages_per_rank  # type: ignore[operator]
        microbatches = handler.num_microbatches or num_stages
        points = resolve_split_points(model, handler.split_points, num_stages)
        example_args, example_kwargs = _example_microbatch(model, handler, microbatches)
        on_meta = has_meta_tensors(model)  # only this rank's stages get memory (see .meta_init)
        with meta_stand_ins(model) if on_meta else nullcontext({}) as real_tensors, traced_in_training(model):
            modules = trace_stages(model, example_args, points, example_kwargs)
        indices = stage_indices(
            self.pp_mesh.get_local_rank(), pp_size, handler.stages_per_rank, handler.stage_layout
        )  # type: ignore[arg-type]
        local = [modules[index] for index in indices]
        follow_module_modes(local)  # model.train()/eval() switch the stages (see .modes)
        copy_modes(model, local)
        _warn_random_operators(model, local)
        put_back(local, real_tensors)
        here = {id(p) for module in local for p in module.parameters()}
        self._names |= {id(p): name for name, p in model.named_parameters()}
        self._elsewhere |= {id(p) for p in model.parameters() if id(p) not in here}
        owners = [owner for module in local for owner in parameter_owners(module)]
        uninitialised = materialise(local, self.device) if on_meta else []
        if device_placement:
            for module in local:
                module.to(self.device)
        for module in local:  # bf16: each stage computes under autocast and hands fp32 activations on, the
            self.precision.wrap_forward(module)  # dtype the traced stages' receive buffers expect
        fsdp_mesh = self.mesh
        if fsdp_mesh is not None:
            for module in local:
                self._shard_stage(module, fsdp_mesh)
        self._record_replacements(owners)
        layout = (pp_size, handler.stages_per_rank, handler.stage_layout)
        pipelined = PipelinedModel(
            self._stages(local, indices, num_stages),
            schedule_class=_schedule_class(handler.schedule_class_name),
            num_microbatches=microbatches,
            persistent_keys=list(model.state_dict()),
            group=self.pp_mesh.get_group(),
            last_stage_rank=next(r for r in range(pp_size) if num_stages - 1 in stage_indices(r, *layout)),  # type: ignore[arg-type]
            training=model.training,
            built_on_meta=on_meta,
            uninitialised=uninitialised,
            source_modules=dict(model.named_modules()) if on_meta else None,
        )
        self.sharded_models.append(pipelined)
        return pipelined

    def _shard_stage(self, module: nn.Module, mesh: DeviceMesh) -> None:
        """One FSDP unit per stage (the traced stage has no block classes left to wrap apart)."""
        fully_shard(
            module,
            mesh=mesh,
            reshard_after_forward=self.plugin.reshard_after_forward,
            mp_policy=self.mp_policy,
            offload_policy=self.offload_policy,
        )
        sum_reductions_on_gloo(module)

    def _stages(self, modules: list[nn.Module], indices: list[int], num_stages: int) -> list[Any]:
        group = self.pp_mesh.get_group()
        return [
            BufferKeepingStage(module, index, num_stages, self.device, group=group)
            for module, index in zip(modules, indices, strict=True)
        ]

    # -- optimizers -------------------------------------------------------------------------------
    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Re-bind to this rank's (sharded) parameters; parameters other pipeline ranks hold are dropped."""
        self._optimizer_names[optimizer] = full_load.original_names(optimizer, self._names)
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) not in self._elsewhere]
        return super().prepare_optimizer(optimizer)

    # -- training step ----------------------------------------------------------------------------
    def pipeline_step(
        self,
        model: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        target: Any,
        loss_fn: Any,
        accumulation_steps: int,
    ) -> torch.Tensor | None:
        if not isinstance(model, PipelinedModel):
            raise TypeError(
                f"pipeline_step() needs the model prepare() returned (a PipelinedModel), got {type(model).__name__}."
            )
        loss_fn = loss_fn if loss_fn is not None else self.handler.loss_fn
        if loss_fn is None:
            raise ValueError(
                "pipeline_step() needs a loss function for the last stage: pass pipeline_step(model, inputs, "
                "target=labels, loss_fn=fn) or TorchPipelineParallelConfig(loss_fn=fn), where fn(outputs, target) "
                "returns the mean loss of a micro-batch."
            )
        if target is None and model.holds_last_stage:
            raise ValueError(
                "pipeline_step() needs target=... on the ranks holding the last stage (the labels its loss "
                "function reads); the other ranks may pass target=None."
            )
        return model.train_step(
            args, kwargs, target=target, loss_fn=loss_fn, accumulation_steps=accumulation_steps
        )

    def load_whole_model(self, model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
        full_load.load_full_model(model, state_dict)

    def causal_lm_loss(self, outputs: Any, labels: torch.Tensor) -> torch.Tensor:
        from lockstep.backends.pp.transformers_models import causal_lm_loss

        return causal_lm_loss(outputs, labels)

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip by the norm of every stage's gradients together (reduced over ``dp_shard``, then ``pp``)."""
        grads = [p.grad for p in parameters if p.grad is not None]
        norm_type = float(norm_type)
        local = global_grad_norm(grads, norm_type, self.state).to(self.device)
        group = self.pp_mesh.get_group()
        if math.isinf(norm_type):
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
            total = local
        else:
            powered = local**norm_type
            dist.all_reduce(powered, op=dist.ReduceOp.SUM, group=group)
            total = powered ** (1.0 / norm_type)
        scale_to_max_norm(grads, total, max_norm)
        return total

    # -- state dicts and checkpoints --------------------------------------------------------------
    @property
    def _writes_shards(self) -> bool:
        # Every pipeline rank writes its own stages: no rank holds the whole model to write it in one file.
        return True

    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The whole model's weights on the main process (every stage gathered; {} on the others)."""
        if not isinstance(model, PipelinedModel):
            return gathered_state_dict(getattr(model, "_orig_mod", model))
        local = {
            key: (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu()
            for key, value in model.state_dict().items()
        }
        gathered: list[Any] = [None] * dist.get_world_size() if self.state.is_main_process else []
        dist.gather_object(local, gathered if self.state.is_main_process else None, dst=0)
        if not self.state.is_main_process:
            return {}
        merged = {key: value for part in gathered for key, value in part.items()}
        return {key: merged[key] for key in model.key_order if key in merged}

    def read_model_states(self, models: Indexed, optimizers: Indexed, folder: Path) -> Any:
        """Every pipeline rank reads how each model is stored, and whole model files itself (its stages'
        entries only are used: there is no main process holding the whole model to send from)."""
        sharded_models, sharded_optimizers, other_models, other_optimizers = self._split(models, optimizers)
        Backend.read_model_states(self, other_models, other_optimizers, folder)
        return shards.read_contents(
            folder, [i for i, _ in sharded_models], [i for i, _, _ in sharded_optimizers]
        )

    def apply_model_states(self, models: Indexed, optimizers: Indexed, loaded: Any) -> None:
        contents: shards.FolderContents = loaded
        sharded_models, sharded_optimizers, _, _ = self._split(models, optimizers)
        for index, model in sharded_models:
            if contents.models[index] == shards.FULL:
                full_load.load_full_model(model, contents.full_models[index])
        for index, model, optimizer in sharded_optimizers:
            if contents.optimizers[index] == shards.FULL:
                inner = getattr(optimizer, "optimizer", optimizer)
                names = self._optimizer_names.get(inner)
                full_load.load_full_optimizer(model, optimizer, contents.full_optimizers[index], names)
        shards.load_contents(
            contents,
            [(i, m) for i, m in sharded_models if contents.models[i] == shards.SHARDS],
            [(i, m, o) for i, m, o in sharded_optimizers if contents.optimizers[i] == shards.SHARDS],
            distributed=True,
        )


def _warn_random_operators(model: nn.Module, stages: list[nn.Module]) -> None:
    suspects = training_only_suspects(stages)
    if suspects:
        warnings.warn(
            f"The pipeline stages of {type(model).__name__} draw random numbers outside dropout "
            f"({', '.join(suspects[:5])}). The model is traced in training mode, so if its forward draws them "
            "only when self.training, they are drawn after model.eval() too and evaluation differs from the "
            "unpipelined model's (the trace holds no sign of such a branch). Ignore this if the noise is meant in "
            "both modes; dropout modules and functions are switched by model.eval() as in PyTorch.",
            UserWarning,
            stacklevel=4,
        )


def _schedule_class(name: str) -> type:
    import torch.distributed.pipelining as pipelining

    schedule = getattr(pipelining, name, None)
    if schedule is None:
        raise NotImplementedError(
            f"The pipeline schedule {name} is not in this torch ({torch.__version__}): upgrade torch or choose "
            "another TorchPipelineParallelConfig(schedule=...)."
        )
    return schedule


def _example_microbatch(
    model: nn.Module, handler: TorchPipelineParallelConfig, microbatches: int
) -> tuple[tuple[Any, ...], dict[str, Any] | None]:
    """The first micro-batch of ``example_args`` and ``example_kwargs``, on the model's device, to trace the
    model with."""
    if handler.example_args is None and handler.example_kwargs is None:
        raise ValueError(
            f"Pipeline parallelism traces {type(model).__name__} once to cut it into stages, and needs an example "
            "batch of its inputs: pass ParallelismConfig(pp_size=..., pp_handler=TorchPipelineParallelConfig("
            "example_args=(inputs,))) with inputs shaped like one batch given to pipeline_step."
        )
    args, kwargs = tuple(handler.example_args or ()), handler.example_kwargs
    for value in (*args, *(kwargs or {}).values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] % microbatches:
            raise ValueError(
                f"TorchPipelineParallelConfig(example_args=...) has a batch of {value.shape[0]}, which "
                f"{microbatches} micro-batches do not divide. Give a batch shaped like the training batches."
            )
    device = next(model.parameters()).device
    micro_kwargs = None if kwargs is None else dict(first_microbatch(dict(kwargs), microbatches, device))
    return tuple(first_microbatch(args, microbatches, device)), micro_kwargs
