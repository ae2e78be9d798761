"""What expert parallelism saves in memory: the bytes of a rank's experts apart from its dense part.

Under DDP (``ParallelismConfig(ep_size=ep)``) each rank of an expert-parallel group of size ``ep`` holds
``num_experts / ep`` experts of every block, their gradients and their optimizer state, whatever the number of
data-parallel processes ``ep`` divides (more processes replicate each shard, no rank holds more); the dense part
(attention, embeddings, routers, norms, shared experts) is replicated by DDP, whole on every rank. Under FSDP2
(``ParallelismConfig(dp_shard_size=N, ep_size=ep)``) each rank holds ``1 / N`` of the dense part and its
``num_experts / ep`` experts sharded over the ``N / ep`` ranks that hold the same ones (its replica group):
``num_experts / N`` experts' rows per block. :func:`expert_memory` measures both parts on a rank (through
:func:`lockstep.memory_accounting.account_parameters`, which counts a DTensor's local shard, ``to_local()``, so
FSDP2's sharded parameters, gradients and Adam moments count as what this rank holds); :func:`count_experts`
counts a model's expert elements for ``lockstep estimate-memory --ep-size`` (with ``--dp-shard`` for FSDP2; the
formula, with the other strategies', is
:func:`lockstep.memory.estimate.formulas.expert_parallel_model_state_bytes`).

Example:
    >>> from lockstep.layers.expert_parallel import expert_memory
    >>> held = expert_memory(model, optimizer)  # doctest: +SKIP
    >>> held.experts.parameter_bytes, held.dense.parameter_bytes, held.experts_per_block  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from lockstep.layers.expert_parallel._blocks import find_moe_blocks, recognised_blocks
from lockstep.memory.accounting import MemoryAccount, account_parameters


@dataclass(frozen=True)
class ExpertMemory:
    """The bytes one rank holds, its experts apart from the rest."""

    experts: MemoryAccount
    """The experts this rank holds: their parameters, gradients and optimizer state."""
    dense: MemoryAccount
    """Everything else of the model (replicated over the expert-parallel ranks)."""
    experts_per_block: dict[str, int]
    """Block name -> the experts of that block this rank routes to (``num_experts / ep_size`` under expert
    parallelism, ``num_experts`` in one process)."""
    expert_rows_per_block: dict[str, int]
    """Block name -> the rows (experts) of the block's expert parameters this rank stores: as
    :attr:`experts_per_block` under DDP, ``num_experts / dp_shard_size`` under FSDP2 (its experts sharded over
    its replica group); measured on the local shard."""


@dataclass(frozen=True)
class ExpertCount:
    """A model's experts, as :func:`count_experts` finds them."""

    num_experts: dict[str, int]
    """Block name -> the experts of the whole block."""
    expert_parameters: int
    """Elements of every block's expert parameters, all experts."""


def _experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Block name -> its experts module, expert-parallel (a shard) or not (which :func:`find_moe_blocks`,
    checking the fused one-process shape, would refuse)."""
    table = recognised_blocks()
    found = {
        name: getattr(module, table[type(module).__name__])
        for name, module in model.named_modules()
        if type(module).__name__ in table
    }
    if not found:
        find_moe_blocks(model)  # raises MoEModelNotSupportedError, naming what is recognised
    return found


def _local_experts(module: nn.Module) -> int:
    """The experts a (possibly swapped) experts module holds on this rank."""
    return int(getattr(module, "num_local_experts", module.num_experts))


def _stored_rows(module: nn.Module) -> int:
    """The rows of the experts module's first 3-D parameter stored on this rank (a DTensor's local shard)."""
    for param in module.parameters():
        local = param.to_local() if callable(getattr(param, "to_local", None)) else param
        if param.dim() == 3:
            return int(local.shape[0])
    return _local_experts(module)  # experts kept as a list of modules: no fused rows to shard


def expert_memory(
    model: nn.Module, optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] = ()
) -> ExpertMemory:
    """The bytes this rank holds in ``model``'s experts and in the rest of it, with ``optimizers``' state.

    Args:
        model: a model with recognised MoE blocks, expert-parallel or not (unwrap a prepared one first:
            ``accelerator.unwrap_model``).
        optimizers: the optimizers training it (prepared or not).

    Raises:
        MoEModelNotSupportedError: ``model`` has no recognised MoE block.
    """
    blocks = _experts_modules(model)
    expert_ids = {id(p) for experts in blocks.values() for p in experts.parameters()}
    experts = [p for p in model.parameters() if id(p) in expert_ids]
    dense = [p for p in model.parameters() if id(p) not in expert_ids]
    optimizer_list = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
    return ExpertMemory(
        experts=account_parameters(experts, optimizer_list),
        dense=account_parameters(dense, optimizer_list),
        experts_per_block={name: _local_experts(experts) for name, experts in blocks.items()},
        expert_rows_per_block={name: _stored_rows(experts) for name, experts in blocks.items()},
    )


def count_experts(model: nn.Module) -> ExpertCount:
    """Every recognised block's number of experts, and the elements of all their expert parameters.

    ``model`` may be on the meta device (as ``lockstep estimate-memory`` builds it) and must not be
    expert-parallel already (its blocks would hold a shard).

    Raises:
        MoEModelNotSupportedError: ``model`` has no recognised MoE block.
    """
    blocks = find_moe_blocks(model)
    elements = sum(p.numel() for block in blocks for p in block.experts.parameters())
    return ExpertCount({block.name: block.num_experts for block in blocks}, elements)
