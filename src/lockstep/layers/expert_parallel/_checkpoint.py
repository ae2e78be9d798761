"""Checkpoints of an expert-parallel model in the layout one process has, through torch's own state-dict hooks.

Each rank holds experts ``[first, first + n)`` of every block under the original parameter names; one process
holds all ``E`` of them under the same names (transformers 5's fused ``gate_up_proj`` and ``down_proj``,
indexed by expert along dimension 0). The optimizer built on the model keeps its parameters in the same
order (the layer swaps each full expert tensor for its shard in place), so an optimizer state dict's
parameter indices are the same on both; only the expert parameters' per-element states (Adam's ``exp_avg``
and ``exp_avg_sq``, SGD's ``momentum_buffer``) have ``n`` rows instead of ``E``. So:

* saving: :meth:`ExpertStateDicts.gather` (run by the layer's ``before_checkpoint``, on every rank together
  before anything is written) all-gathers every block's experts over the expert-parallel group, in rank order,
  and for ``save_state`` every expert parameter's optimizer states. With ``ep_size`` smaller than the
  data-parallel size each ep group gathers its own (the replicas hold the same experts and moments, so every
  group has the one-process layout, and the writing process's group is the one written); the hooks then put the full tensors into
  the next ``state_dict()`` of each experts module (``nn.Module.register_state_dict_post_hook``) and of each
  prepared optimizer (``Optimizer.register_state_dict_post_hook``). lockstep calls the model's
  ``state_dict()`` on every rank, but the optimizer's only on the processes that write the shared files, so
  the gathering cannot happen inside the hooks (a collective there would wait for the other ranks forever): it
  happens before, and no hook ever communicates. A plain ``state_dict()`` outside a checkpoint gives this
  rank's shard, and a rank that did not use its gathered tensors drops them at the next optimizer step or load;
* loading: the load pre-hooks (``nn.Module.register_load_state_dict_pre_hook``,
  ``Optimizer.register_load_state_dict_pre_hook``) take this rank's rows out of full tensors (``E`` rows) and
  keep shards (``n`` rows) as they are; they need no communication, so any ``load_state_dict`` call works,
  a checkpoint saved on one process, on ``ep=2`` or on ``ep=4`` alike.

Under FSDP2 (``dp_shard_size``) each expert parameter and its moments are DTensors on the replica group's mesh
holding this ep rank's experts. Saving gathers them with ``full_tensor()`` first, then over the ep group as
above: every ep group offers the same whole tensors (plain, so ``torch.distributed.checkpoint`` writes each once
under its one-process name, instead of each ep group's piece under the same name). Loading: ``expect_load`` (no
communication) makes the next ``state_dict()`` of the experts modules and optimizers hold uninitialised tensors
of the one-process shape, which DCP reads the saved ones into; the load pre-hooks take this rank's rows and
shard them as the parameter is (``distribute_tensor(..., src_data_rank=None)``: each rank keeps its piece).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, final

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lockstep.layers.expert_parallel._dispatch import ExpertParallelExperts
from lockstep.layers.expert_parallel._errors import ExpertParallelNotBuiltError


@dataclass(frozen=True)
class _Shard:
    """Where one expert parameter's rows lie in the full tensor."""

    module: ExpertParallelExperts
    name: str

    @property
    def rows(self) -> slice:
        return slice(self.module.first_expert, self.module.first_expert + self.module.num_local_experts)


def _gather_rows(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's ``local`` (the same shape on each), concatenated along dimension 0 in rank order. Under
    FSDP2 ``local`` is a DTensor on the replica group's mesh: its full tensor (this rank's experts) first."""
    if isinstance(local, DTensor):
        local = local.full_tensor()
    local = local.detach().contiguous()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return torch.cat(parts)


def _this_ranks_rows(value: Any, param: torch.Tensor, shard: _Shard, where: str) -> Any:
    """``value`` (a saved tensor of the expert parameter ``param``) as this rank holds it: its rows of a full
    tensor, a shard as it is; scalars and other objects unchanged. Under FSDP2 (``param`` a DTensor on the
    replica group's mesh) the rows are sharded as ``param`` is, with no communication."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    if value.shape == param.shape:
        return value if isinstance(value, DTensor) or not isinstance(param, DTensor) else _like(value, param)
    num_experts = shard.module.num_experts
    if value.shape[0] == num_experts and value.shape[1:] == param.shape[1:]:
        if isinstance(value, DTensor):  # torch's full-state-dict load distributed it as param's mesh says
            value = value.full_tensor()
        rows = value[shard.rows].clone()
        return _like(rows, param) if isinstance(param, DTensor) else rows
    raise ValueError(
        f"{where} has shape {tuple(value.shape)}, which is neither the whole {num_experts} experts "
        f"({(num_experts, *param.shape[1:])}) nor this rank's {shard.module.num_local_experts} "
        f"({tuple(param.shape)}): the checkpoint was saved from another model. Load one saved from this model."
    )


def _like(rows: torch.Tensor, param: DTensor) -> DTensor:
    """This rank's ``rows`` (the whole of what ``param`` holds) sharded as ``param`` is; every rank of its mesh
    holds the same ``rows`` and keeps its own piece (``src_data_rank=None``: nothing is sent)."""
    return distribute_tensor(rows.to(param.device), param.device_mesh, param.placements, src_data_rank=None)


def _function(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` as a plain function: torch marks the hooks it registers with an attribute, which a bound
    method cannot take (and a function is shared, not copied, when the model is deep-copied)."""

    def hook(*args: Any) -> Any:
        return method(*args)

    return hook


def _innermost(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside the Accelerator's wrapper (whose ``state_dict`` calls the inner one)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


@final
class ExpertStateDicts:
    """The state-dict hooks of every expert-parallel model and optimizer of one Accelerator.

    Args:
        group: the expert-parallel process group.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group = group
        self._shards: dict[int, _Shard] = {}  # id of an expert shard -> where its rows lie
        self._optimizers: list[torch.optim.Optimizer] = []
        self._gathered_modules: dict[int, dict[str, torch.Tensor]] = {}
        self._gathered_optimizers: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
        self._full_shaped_modules = (
            False  # a load next: the experts' state dicts full-shaped, nothing gathered
        )
        self._full_shaped_optimizers = False

    def add_experts(self, modules: Iterable[ExpertParallelExperts]) -> None:
        """Hook the experts modules of a model that was just sharded (those hooked already are skipped)."""
        for module in modules:
            if any(id(param) in self._shards for param in module.parameters(recurse=False)):
                continue
            for name, param in module.named_parameters(recurse=False):
                self._shards[id(param)] = _Shard(module, name)
            module.register_state_dict_post_hook(_function(self._module_state_dict))
            module.register_load_state_dict_pre_hook(_function(self._load_module_state_dict))

    def add_optimizer(self, optimizer: Any) -> None:
        """Hook a prepared optimizer (its parameters already this rank's shards)."""
        inner = _innermost(optimizer)
        if any(inner is known for known in self._optimizers):
            return
        self._optimizers.append(inner)
        inner.register_state_dict_post_hook(_function(self._optimizer_state_dict))
        inner.register_load_state_dict_pre_hook(_function(self._load_optimizer_state_dict))

    def forget_gathered(self) -> None:
        """Drop the gathered tensors no ``state_dict()`` used (at each optimizer step and load: they are stale)."""
        self._gathered_modules.clear()
        self._gathered_optimizers.clear()
        self._full_shaped_modules = self._full_shaped_optimizers = False

    def expect_load(self) -> None:
        """Under FSDP2, before a load (every rank, no communication): the next ``state_dict()`` of each experts
        module and optimizer holds uninitialised tensors of the one-process shape, which
        ``torch.distributed.checkpoint`` reads the saved ones into (a DCP checkpoint stores the one-process
        layout; this rank's DTensor, a piece of its own experts, matches no saved tensor). The load pre-hooks
        then take this rank's rows and shard them as the parameters are."""
        self.forget_gathered()
        self._full_shaped_modules = self._full_shaped_optimizers = True

    def _full_shaped(self, param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        num_experts = self._shards[id(param)].module.num_experts
        local = value.to_local() if isinstance(value, DTensor) else value
        return torch.empty((num_experts, *value.shape[1:]), dtype=value.dtype, device=local.device)

    # -- saving -------------------------------------------------------------------------------------
    @torch.no_grad()
    def gather(self, *, optimizers: bool) -> None:
        """Every rank together: gather the full experts (and, with ``optimizers``, their optimizer states) for
        the next ``state_dict()`` of each experts module and optimizer."""
        self.forget_gathered()
        for optimizer in self._optimizers if optimizers else ():
            self._check_shapes(optimizer)  # before the first collective: every rank refuses alike
        modules = {id(shard.module): shard.module for shard in self._shards.values()}
        for key, module in modules.items():
            self._gathered_modules[key] = {
                name: _gather_rows(param, self._group)
                for name, param in module.named_parameters(recurse=False)
            }
        if optimizers:
            for optimizer in self._optimizers:
                self._gathered_optimizers[id(optimizer)] = self._gather_optimizer(optimizer)

    def _expert_states(self, optimizer: torch.optim.Optimizer) -> Iterator[tuple[int, nn.Parameter, dict]]:
        """(index in its state dict, parameter, state) of each expert parameter ``optimizer`` holds state of."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for index, param in enumerate(params):
            if id(param) in self._shards and param in optimizer.state:
                yield index, param, optimizer.state[param]

    def _check_shapes(self, optimizer: torch.optim.Optimizer) -> None:
        for _, param, state in self._expert_states(optimizer):
            for key in sorted(state):
                value = state[key]
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                    raise ExpertParallelNotBuiltError(
                        f"{type(optimizer).__name__}'s state {key!r} of an expert parameter has shape "
                        f"{tuple(value.shape)}, not the parameter's {tuple(param.shape)}: lockstep gathers "
                        "optimizer states of expert-parallel parameters element by element (Adam, AdamW, SGD and "
                        "other optimizers whose states have the parameter's shape), and cannot save this one yet. "
                        "Use such an optimizer, or train without ParallelismConfig(ep_size=...)."
                    )

    def _gather_optimizer(self, optimizer: torch.optim.Optimizer) -> dict[int, dict[str, torch.Tensor]]:
        """The full states of ``optimizer``'s expert parameters, by their index in its state dict (the
        scalars, such as Adam's ``step``, are the same on every rank and stay as they are)."""
        return {
            index: {
                key: _gather_rows(state[key], self._group)
                for key in sorted(state)
                if isinstance(state[key], torch.Tensor) and state[key].dim() > 0
            }
            for index, _, state in self._expert_states(optimizer)
        }

    def _module_state_dict(
        self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
    ) -> None:
        full = self._gathered_modules.pop(id(module), None)
        if full is None and self._full_shaped_modules:
            full = {
                name: self._full_shaped(param, param)
                for name, param in module.named_parameters(recurse=False)
            }
        if full is not None:
            for name, tensor in full.items():
                state_dict[prefix + name] = tensor

    def _optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        full = self._gathered_optimizers.pop(id(optimizer), None)
        if full is None and self._full_shaped_optimizers:
            full = {
                index: {
                    key: self._full_shaped(param, value)
                    for key, value in state.items()
                    if isinstance(value, torch.Tensor) and value.dim() > 0
                }
                for index, param, state in self._expert_states(optimizer)
            }
        if not full:
            return None
        state = dict(state_dict["state"])  # its per-parameter dicts are the optimizer's live ones: copies
        for index, tensors in full.items():
            state[index] = {**state[index], **tensors}
        state_dict["state"] = state
        return None

    # -- loading ------------------------------------------------------------------------------------
    def _load_module_state_dict(
        self,
        module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        self._gathered_modules.clear()  # stale (the optimizers' may be loaded next)
        for name, param in module.named_parameters(recurse=False):
            key = prefix + name
            if key in state_dict:
                shard = self._shards[id(param)]
                state_dict[key] = _this_ranks_rows(state_dict[key], param, shard, f"the saved {key!r}")

    def _load_optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
    ) -> dict[str, Any]:
        self._gathered_optimizers.clear()
        # the saved groups name their parameters as their state is keyed: by index (torch's own state dict) or
        # by name (torch.distributed.checkpoint's set_optimizer_state_dict), in this optimizer's order
        saved = [key for group in state_dict.get("param_groups", []) for key in group["params"]]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        state = dict(state_dict.get("state", {}))
        for index, param in zip(saved, params, strict=False):
            if id(param) not in self._shards or index not in state:
                continue
            shard = self._shards[id(param)]
            state[index] = {
                key: _this_ranks_rows(
                    value,
                    param,
                    shard,
                    f"{type(optimizer).__name__}'s saved state {key!r} of parameter {index}",
                )
                for key, value in state[index].items()
            }
        return {**state_dict, "state": state}
