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
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, final

import torch
import torch.distributed as dist
from torch import nn

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
    """Every rank's ``local`` (the same shape on each), concatenated along dimension 0 in rank order."""
    local = local.detach().contiguous()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return torch.cat(parts)


def _this_ranks_rows(value: Any, param: torch.Tensor, shard: _Shard, where: str) -> Any:
    """``value`` (a saved tensor of the expert parameter ``param``) as this rank holds it: its rows of a full
    tensor, a shard as it is; scalars and other objects unchanged."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape == param.shape:
        return value
    num_experts = shard.module.num_experts
    if value.shape[0] == num_experts and value.shape[1:] == param.shape[1:]:
        return value[shard.rows].clone()
    raise ValueError(
        f"{where} has shape {tuple(value.shape)}, which is neither the whole {num_experts} experts "
        f"({(num_experts, *param.shape[1:])}) nor this rank's {shard.module.num_local_experts} "
        f"({tuple(param.shape)}): the checkpoint was saved from another model. Load one saved from this model."
    )


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

    def add_experts(self, modules: Iterable[ExpertParallelExperts]) -> None:
        """Hook the experts modules of a model that was just sharded."""
        for module in modules:
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
        if full is not None:
            for name, tensor in full.items():
                state_dict[prefix + name] = tensor

    def _optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        full = self._gathered_optimizers.pop(id(optimizer), None)
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
        self.forget_gathered()
        for name, param in module.named_parameters(recurse=False):
            key = prefix + name
            if key in state_dict:
                shard = self._shards[id(param)]
                state_dict[key] = _this_ranks_rows(state_dict[key], param, shard, f"the saved {key!r}")

    def _load_optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
    ) -> dict[str, Any]:
        self.forget_gathered()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        state = dict(state_dict.get("state", {}))
        for index, param in enumerate(params):
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
