"""Expert parallelism under the Accelerator: a layer of step hooks the layout's ``ep_size`` turns on.

The backend (DDP, or FSDP2 with ``dp_shard_size``) trains the dense weights as usual; this layer's moments
(:mod:`lockstep.step_hooks`) add the experts. Under FSDP2 (:mod:`lockstep.layers.expert_parallel._fsdp`),
``preparing_model`` has the backend ``fully_shard`` each experts module over its replica group first (the
backend's :class:`~lockstep.backends.capabilities.SeparateSharding`), FSDP2 reduces and divides the expert
gradients, the clip sums every rank's shards once, and checkpoints hold the one-process layout as under DDP
(``before_checkpoint`` gathers the experts over the replica group, then the ep group; before a load the experts'
state dicts are one-process-shaped for DCP to read into). Under DDP:

* ``preparing_model``: before DDP wraps a model, its experts are sharded over ep groups of ``ep_size``
  consecutive data-parallel ranks (:func:`apply_expert_parallel`; the first model prepared creates the process
  groups, :mod:`lockstep.layers.expert_parallel._groups`, on every rank together) and named in DDP's list of
  parameters to leave alone (torch's ``_ddp_params_and_buffers_to_ignore``, which DDP reads when it wraps the
  module): their gradients are not replicas over every rank to average, each rank of an ep group holds other
  experts;
* ``prepared_optimizer``: an optimizer built on the model before ``prepare`` holds its full expert tensors,
  which the sharding replaced; they are swapped for this rank's shards (before the first step);
* ``around_backward``: a new backward starts the step's gradients again (the expert gradients are not yet
  scaled);
* ``before_clip`` (on a synchronising step) and ``around_optimizer_step``: the expert gradients are summed over
  the replicas of each shard (with ``ep_size`` smaller than the data-parallel size) and divided by the
  data-parallel size once per optimizer step, also with gradient accumulation (their all-to-all's backward
  summed the ep group's tokens into them; DDP averaged the dense ones);
* ``clip_grad_norm_``: the clip uses the norm over the dense gradients and every expert once (summed over the
  ep group, not the replicas), as one process;
* ``loss_multiplied_by`` (the :class:`GlobalLossTerm` capability): a loop that multiplies each rank's loss by
  the number of replicas (the Trainer's ``num_items_in_batch`` summed over the processes) says so around the
  forward, and the global router loss's share in each rank's loss is divided by it;
* ``before_checkpoint``: ``save_state``, ``save_model`` and ``get_state_dict`` get the one-process layout (every
  rank's experts gathered first; ``save_state`` also the optimizer states), and ``load_state`` slices this
  rank's experts out of it (:mod:`lockstep.layers.expert_parallel._checkpoint`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, final

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lockstep.backends.capabilities import GlobalLossTerm, JointPreparation, SeparateSharding
from lockstep.layers.expert_parallel._apply import (
    ExpertParallel,
    apply_expert_parallel,
    check_divisible,
    clip_by_global_norm,
)
from lockstep.layers.expert_parallel._blocks import find_moe_blocks
from lockstep.layers.expert_parallel._checkpoint import ExpertStateDicts
from lockstep.layers.expert_parallel._errors import ExpertParallelNotBuiltError, ExpertShardingError
from lockstep.layers.expert_parallel._fsdp import (
    clip_fully_sharded,
    divide_once_on_one_rank,
    replica_mesh,
    shard_experts_apart,
)
from lockstep.layers.expert_parallel._groups import ExpertParallelGroups, expert_parallel_groups
from lockstep.step_hooks import StepHook

_NEXT = "it comes next (see lockstep.layers.expert_parallel)"


@final
class ExpertParallelLayer(StepHook, GlobalLossTerm):
    """The step hooks of expert parallelism borrowed from data parallelism (DDP, or FSDP2's ``dp_shard``).

    Args:
        ep_size: the ranks each model's experts are sharded over; it divides the data-parallel size (the
            world), and each shard is replicated over the ``world / ep_size`` ranks with the same rank in their
            ep group.
        sync_gradients: whether the current step synchronises gradients (not a micro-step of accumulation).
        sharding: under FSDP2 (``dp_shard_size``), the backend's capability to shard the experts modules over
            their replica groups first (:mod:`lockstep.layers.expert_parallel._fsdp`); None under DDP.
        device_type: the device the replica groups' mesh is built for (with ``sharding``).
    """

    def __init__(
        self,
        *,
        ep_size: int,
        sync_gradients: Callable[[], bool],
        sharding: SeparateSharding | None = None,
        device_type: str = "cpu",
    ) -> None:
        self._ep_size = ep_size
        self._sync_gradients = sync_gradients
        self._sharding = sharding
        self._device_type = device_type
        self._replica_mesh: DeviceMesh | None = None
        self._groups: ExpertParallelGroups | None = None
        self.parallel: list[ExpertParallel] = []
        """One per prepared model, in the order they were prepared."""
        self._sharded: dict[int, nn.Parameter] = {}  # id of a full expert tensor -> this rank's shard
        self._scaled = False
        self._state_dicts: ExpertStateDicts | None = None

    def preparing_model(self, model: Any) -> Any:
        full = dict(model.named_parameters())
        groups = self._process_groups(model)
        parallel = apply_expert_parallel(model, groups)
        self.parallel.append(parallel)
        if self._sharding is not None:  # FSDP2: the experts sharded over their replicas, then the dense ones
            if self._replica_mesh is None:
                self._replica_mesh = replica_mesh(groups, self._device_type)
            shard_experts_apart(parallel, full, sharding=self._sharding, mesh=self._replica_mesh)
            return model  # the state-dict hooks: in prepared_model, once the backend placed every parameter
        expert_ids = {id(p) for p in parallel.expert_parameters()}
        names = [name for name, param in model.named_parameters() if id(param) in expert_ids]
        for name in names:
            self._sharded[id(full[name])] = dict(model.named_parameters())[name]
        # The experts are sharded, not replicated over every rank: the data-parallel backend must neither
        # broadcast nor average them (their replicas, if any, are summed over the replica group). torch's DDP leaves out the parameters its module names in this attribute and those marked
        # _ddp_ignored (what its _set_params_and_buffers_to_ignore_for_model writes, with the same names).
        model._ddp_params_and_buffers_to_ignore = names
        for param in parallel.expert_parameters():
            param._ddp_ignored = True
        if self._state_dicts is None:
            self._state_dicts = ExpertStateDicts(parallel.group)
        self._state_dicts.add_experts(parallel.experts.values())
        return model

    def _process_groups(self, model: Any) -> ExpertParallelGroups:
        """The groups, created by the first model prepared (every rank prepares the same models in the same
        order), after its checks: a model the layer refuses creates none."""
        if self._groups is None:
            # apply_expert_parallel's check, run here before the groups' collective
            check_divisible(find_moe_blocks(model), self._ep_size)
            self._groups = expert_parallel_groups(self._ep_size)
        return self._groups

    def prepared_model(self, model: object) -> None:
        if self._sharding is not None and self._replica_mesh is not None:
            for parallel in self.parallel:
                parallel.parameters_replaced()  # the backend replaced the dense parameters by its sharded ones
                divide_once_on_one_rank(parallel, self._replica_mesh)
            if self._state_dicts is None:
                self._state_dicts = ExpertStateDicts(self.parallel[0].group)
            for parallel in self.parallel:  # those hooked already are skipped
                self._state_dicts.add_experts(parallel.experts.values())

    def prepared_optimizer(self, optimizer: Any) -> None:
        stale = [p for group in optimizer.param_groups for p in group["params"] if id(p) in self._sharded]
        if stale and any(p in optimizer.state for p in stale):
            raise RuntimeError(
                f"{type(optimizer).__name__} has stepped on the model's full expert tensors before prepare(): with "
                "expert parallelism each rank holds its shard of the experts. Prepare the model and the optimizer "
                "before the first optimizer step."
            )
        for group in optimizer.param_groups:
            group["params"] = [self._sharded.get(id(p), p) for p in group["params"]]
        if self._state_dicts is not None:
            self._state_dicts.add_optimizer(optimizer)

    def around_backward(self) -> contextlib.AbstractContextManager[None]:
        self._scaled = False
        return contextlib.nullcontext()

    def before_clip(self) -> None:
        if self._sync_gradients() and self._sharding is None:
            self._scale_once()

    def clip_grad_norm_(
        self, parameters: list[Any], max_norm: float, norm_type: float
    ) -> torch.Tensor | None:
        if not self.parallel:
            return None
        if self._sharding is not None:
            return clip_fully_sharded(parameters, max_norm, norm_type, self.parallel[0].groups.data_parallel)
        expert_ids = {id(p) for parallel in self.parallel for p in parallel.expert_parameters()}
        return clip_by_global_norm(parameters, expert_ids, max_norm, norm_type, self.parallel[0].group)

    @contextlib.contextmanager
    def loss_multiplied_by(self, factor: float) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for parallel in self.parallel:
                stack.enter_context(parallel.loss_multiplier.multiplied_by(factor))
            yield

    def before_checkpoint(self, operation: str) -> None:
        if self._state_dicts is None:
            return
        if operation == "load_state" and self._sharding is not None:
            self._state_dicts.expect_load()  # DCP reads the one-process tensors, the pre-hooks take the rows
        elif operation == "load_state":
            self._state_dicts.forget_gathered()
        else:  # save_state, save_model, get_state_dict: every rank calls them together
            self._state_dicts.gather(optimizers=operation == "save_state")

    @contextlib.contextmanager
    def around_optimizer_step(self, optimizer: object) -> Iterator[None]:
        if self._state_dicts is not None:
            self._state_dicts.forget_gathered()
        if self._sharding is None:  # under FSDP2 its reduce-scatter divides the expert gradients
            self._scale_once()
        yield

    def _scale_once(self) -> None:
        if not self._scaled:
            for parallel in self.parallel:
                parallel.reduce_expert_gradients()
            self._scaled = True


def expert_parallel_hooks(layout: Any, accelerator: Any) -> list[StepHook]:
    """The layer's hooks for ``accelerator`` (its ``LayerSpec``'s builder), given the layout that turned it on.

    Raises:
        ExpertParallelNotBuiltError: a backend that prepares the model together with its optimizer
            (DeepSpeed), or ``dp_shard_size`` with a backend that cannot shard the experts apart. (HSDP, TP, CP
            and pipeline parallelism with ``ep_size`` are refused by ``ParallelismConfig`` itself; an
            ``ep_size`` that does not divide the processes, by its ``validate_world_size``.)
    """
    if accelerator.backend.capability(JointPreparation) is not None:
        raise ExpertParallelNotBuiltError(
            f"ParallelismConfig(ep_size={layout.ep_size}) with DeepSpeed is not built yet: DeepSpeed's engine "
            f"prepares the model itself, so its experts cannot be sharded first; {_NEXT}. Train with DDP "
            "(drop the DeepSpeed plugin) or set ep_size=1."
        )
    if (
        layout.data_parallel_size % layout.ep_size
    ):  # validate_world_size refuses it first; kept for other callers
        raise ExpertShardingError(
            f"ParallelismConfig(ep_size={layout.ep_size}) does not fit {layout.data_parallel_size} data-parallel "
            f"processes: ep_size must divide {layout.data_parallel_size}. Choose an ep_size that divides it."
        )
    sharding, device_type = None, "cpu"
    if layout.dp_shard_size > 1:
        sharding, device_type = accelerator.backend.capability(SeparateSharding), accelerator.device.type
        if sharding is None:
            raise ExpertParallelNotBuiltError(
                f"ParallelismConfig(dp_shard_size={layout.dp_shard_size}, ep_size={layout.ep_size}) with the "
                f"{type(accelerator.backend).__name__} backend is not built: the experts are sharded with FSDP2 "
                "over their replica groups, which this backend cannot do. Use lockstep's FSDP2 backend "
                "(ParallelismConfig's dp_shard_size selects it), or drop dp_shard_size."
            )
    return [
        ExpertParallelLayer(
            ep_size=layout.ep_size,
            sync_gradients=lambda: accelerator.sync_gradients,
            sharding=sharding,
            device_type=device_type,
        )
    ]
