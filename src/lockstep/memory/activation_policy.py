"""Activation memory policies: what each repeated block keeps for backward.

One policy applies to the model's blocks (the FSDP units, or a transformers model's ``_no_split_modules``):

============  ==============================================================================================
``none``      keep every activation (no recomputation)
``full``      keep only each block's input; recompute the whole block in backward (``True`` means this)
``every_<k>`` ``full`` on every k-th block (the k-th, 2k-th, ...), the others keep everything
``op``        selective by operator (torchtitan's ``op`` policy): inside each block keep the outputs of
              matrix multiplications (every second one) and attention, recompute the cheap operators
              (norms, activations, element-wise)
``offload``   keep every activation, in CPU memory: ``torch.autograd.graph.save_on_cpu``'s hooks on each block,
              with pinned buffers on CUDA. On a CPU device the activations already are in CPU memory: nothing
              moves and nothing is copied.
============  ==============================================================================================

Recomputation replays the same operators on the same inputs (with the RNG state restored), so gradients are
bitwise equal to not checkpointing on CPU.

The names and their parsing live in :mod:`lockstep.config.activation_policy` (no torch there), re-exported here.

Example:
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    >>> blocks = apply_activation_policy(model, list(model), parse_activation_policy("every_2", owner="policy"))
    >>> [type(block).__name__ for block in blocks]
    ['Linear', 'CheckpointWrapper']
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    ActivationWrapper,
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lockstep.config.activation_policy import POLICIES, ActivationPolicy, parse_activation_policy

logger = logging.getLogger("lockstep.memory")

__all__ = [
    "POLICIES",
    "ActivationPolicy",
    "apply_activation_policy",
    "parse_activation_policy",
    "selective_op_contexts",
]


def apply_activation_policy(
    model: nn.Module, blocks: Sequence[nn.Module], policy: ActivationPolicy
) -> list[nn.Module]:
    """Wrap ``blocks`` of ``model`` in place by ``policy``; returns the blocks, each replaced by its wrapper
    where the policy wrapped it (same order), so that FSDP can shard the wrappers as units.

    The wrappers are torch's ``ActivationWrapper`` s: their state dict keys are the unwrapped block's.
    """
    wrap = _wrapper(policy)
    _disable_kv_cache(model, policy)
    parents = {
        id(child): (parent, name) for parent in model.modules() for name, child in parent.named_children()
    }
    result = []
    for index, block in enumerate(blocks):
        if block is model or id(block) not in parents:
            raise ValueError(
                f"apply_activation_policy: the block {type(block).__name__} at index {index} is not a submodule "
                f"of {type(model).__name__}; give the model's repeated layers."
            )
        if not policy.checkpoints(index):
            result.append(block)
            continue
        parent, name = parents[id(block)]
        wrapper = wrap(block)
        setattr(parent, name, wrapper)
        parents[id(wrapper)] = (parent, name)
        result.append(wrapper)
    return result


def _disable_kv_cache(model: nn.Module, policy: ActivationPolicy) -> None:
    """A transformers model's KV cache is written again when a block is recomputed (and ``op`` then finds
    more operators in the replay than in the forward): switch it off for training, as transformers does under
    its own gradient checkpointing."""
    config = getattr(model, "config", None)
    if policy.mode in ("full", "every", "op") and getattr(config, "use_cache", False):
        config.use_cache = False
        logger.info(
            "activation policy %s: %s.config.use_cache set to False", policy.name, type(model).__name__
        )


def _wrapper(policy: ActivationPolicy) -> Callable[[nn.Module], nn.Module]:
    if policy.mode in ("full", "every"):
        return functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    if policy.mode == "op":
        return functools.partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT, context_fn=selective_op_contexts
        )
    if policy.mode == "offload":
        return _offload_wrapper
    if policy.mode == "none":
        return lambda block: block  # never called: checkpoints() is False for every block
    raise AssertionError(f"no wrapper for policy {policy.name!r}")


# -- selective by operator ------------------------------------------------------------------------------------


def _save_list() -> frozenset[Any]:
    aten = torch.ops.aten
    names = (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_cudnn_attention",
    )
    ops = {getattr(aten, name).default for name in names if hasattr(aten, name)}
    if hasattr(torch.ops, "_c10d_functional"):  # tensor parallel: do not redo the communication
        ops.add(torch.ops._c10d_functional.reduce_scatter_tensor.default)
    return frozenset(ops)


def selective_op_contexts() -> Any:
    """The ``context_fn`` of torch's checkpoint for the ``op`` policy: save the outputs of the operators in the
    save list (matrix multiplications, attention, tensor-parallel reduce-scatter), except every second plain
    matrix multiplication (torchtitan's rule, which halves what the MLP keeps), and recompute the rest."""
    save = _save_list()
    matmuls = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
    counts: Counter[str] = Counter()  # per pass: the forward and its recomputation count alike

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func not in save:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if func in matmuls:
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            if counts[key] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE

    return create_selective_checkpoint_contexts(policy)


# -- offload --------------------------------------------------------------------------------------------------


OFFLOAD_OBSERVERS: list[Callable[[Any], None]] = []
"""Called with every tensor the ``offload`` policy saves (the memory estimate counts them this way)."""


def _is_parameter(tensor: Any) -> bool:
    return isinstance(tensor, nn.Parameter) or isinstance(getattr(tensor, "_base", None), nn.Parameter)


def _pack_to_cpu(tensor: Any) -> tuple[Any, Any, bool]:
    if _is_parameter(tensor):  # weights (Linear saves weight.t()) stay where they live: no copy per step
        return tensor.device, tensor, False
    for observe in OFFLOAD_OBSERVERS:
        observe(tensor)
    if tensor.device.type in ("cpu", "meta"):  # already host memory; meta: an estimate, nothing to move
        return tensor.device, tensor, False

    pinned = tensor.is_cuda and not tensor.is_sparse
    packed = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pinned)
    packed.copy_(tensor)  # as torch.autograd.graph.save_on_cpu, with pinned memory only on CUDA
    return tensor.device, packed, pinned


def _unpack_from_cpu(packed: tuple[Any, Any, bool]) -> Any:
    device, tensor, pinned = packed
    return tensor.to(device, non_blocking=pinned)


def offload_to_cpu() -> Any:
    """The ``offload`` policy's context: ``torch.autograd.graph.save_on_cpu``'s hooks, with pinned buffers only
    for CUDA tensors (pinning needs CUDA), CPU tensors kept as they are (no copy), and parameters (and views of
    them) left in place, where save_on_cpu would copy the weights to the host on every step."""
    return torch.autograd.graph.saved_tensors_hooks(_pack_to_cpu, _unpack_from_cpu)


class OffloadWrapper(ActivationWrapper):
    """The ``offload`` policy's wrapper: runs the block with its saved activations in CPU memory
    (:func:`offload_to_cpu`). Its state dict keys are the block's, as for torch's checkpoint wrapper."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with offload_to_cpu():
            return self._checkpoint_wrapped_module(*args, **kwargs)


def _offload_wrapper(block: nn.Module) -> nn.Module:
    return OffloadWrapper(block)
