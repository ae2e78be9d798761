"""Which mixture-of-experts blocks expert parallelism recognises, and how it finds them in a model.

A recognised block is a module whose ``experts`` child is a *fused* experts module: its parameters are indexed
by expert along dimension 0 (``gate_up_proj`` of shape ``(num_experts, 2 * intermediate, hidden)`` and
``down_proj`` of shape ``(num_experts, hidden, intermediate)`` in transformers 5), it has a ``num_experts``
attribute, and the block calls it as ``experts(hidden_states, top_k_index, top_k_weights)`` with
``hidden_states`` of shape ``(tokens, hidden)`` and the router's top-k expert indices and weights of shape
``(tokens, top_k)``. That call is the only contract expert parallelism relies on: the router, the
block's forward and the experts' own math stay the model's.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lockstep.layers.expert_parallel._errors import MoEModelNotSupportedError

_RECOGNISED_BLOCKS: dict[str, str] = {
    "Qwen3MoeSparseMoeBlock": "experts",
    "MixtralSparseMoeBlock": "experts",
    "OlmoeSparseMoeBlock": "experts",
    "Qwen2MoeSparseMoeBlock": "experts",
    "DeepseekV3MoE": "experts",  # group-limited sigmoid routing, a shared expert beside, no aux loss
}
"""Sparse-MoE block class name -> the attribute holding its fused experts module (transformers 5.x)."""


def register_moe_block(block_class: type[nn.Module] | str, experts_attribute: str = "experts") -> None:
    """Recognise another sparse-MoE block class, whose experts module has the fused shape described above.

    Args:
        block_class: the block's class, or its ``__name__``.
        experts_attribute: the name of the block's attribute that holds the fused experts module.

    Example:
        >>> from lockstep.layers.expert_parallel import register_moe_block
        >>> register_moe_block("MyMoeSparseMoeBlock")
    """
    name = block_class if isinstance(block_class, str) else block_class.__name__
    _RECOGNISED_BLOCKS[name] = experts_attribute


def recognised_blocks() -> dict[str, str]:
    """A copy of the table: block class name -> experts attribute."""
    return dict(_RECOGNISED_BLOCKS)


@dataclass(frozen=True)
class MoEBlock:
    """One recognised block found in a model."""

    name: str
    """The block's qualified name in the model (``model.layers.0.mlp``)."""
    block: nn.Module
    """The sparse-MoE block."""
    experts_attribute: str
    """The block's attribute that holds the experts module."""

    @property
    def experts(self) -> nn.Module:
        """The block's experts module."""
        return getattr(self.block, self.experts_attribute)

    @property
    def num_experts(self) -> int:
        """How many experts the experts module holds."""
        return int(self.experts.num_experts)


def find_moe_blocks(model: nn.Module) -> list[MoEBlock]:
    """Every recognised sparse-MoE block of ``model``, in module order; checked to have the fused shape.

    Raises:
        MoEModelNotSupportedError: ``model`` holds no recognised block, or a recognised block's experts module
            is not fused (its parameters are not indexed by expert along dimension 0).
    """
    found = [
        MoEBlock(name, module, _RECOGNISED_BLOCKS[type(module).__name__])
        for name, module in model.named_modules()
        if type(module).__name__ in _RECOGNISED_BLOCKS
    ]
    if not found:
        raise MoEModelNotSupportedError(
            f"expert parallelism found no mixture-of-experts block in {type(model).__name__}: it recognises "
            f"the blocks {sorted(_RECOGNISED_BLOCKS)} (transformers 5.x, fused experts). If the model has a "
            "block whose experts module holds 3-D parameters indexed by expert and is called as "
            "experts(hidden_states, top_k_index, top_k_weights), recognise it with "
            "lockstep.layers.expert_parallel.register_moe_block(BlockClass); otherwise train it without expert "
            "parallelism."
        )
    for found_block in found:
        _check_fused(found_block)
    return found


def _check_fused(found: MoEBlock) -> None:
    experts = getattr(found.block, found.experts_attribute, None)
    num_experts = getattr(experts, "num_experts", None)
    params = dict(experts.named_parameters(recurse=False)) if isinstance(experts, nn.Module) else {}
    fused = (
        isinstance(num_experts, int)
        and "down_proj" in params
        and ("gate_up_proj" in params or "up_proj" in params)
        and all(p.dim() >= 2 and p.shape[0] == num_experts for p in params.values())
    )
    if not fused:
        shapes = {name: tuple(p.shape) for name, p in params.items()}
        raise MoEModelNotSupportedError(
            f"the block {found.name!r} ({type(found.block).__name__}) is recognised, but its "
            f"{found.experts_attribute!r} module ({type(experts).__name__}, num_experts={num_experts}, "
            f"parameters {shapes}) is not a fused experts module: expert parallelism needs a down_proj and "
            "parameters indexed by expert along dimension 0. Train this model without expert parallelism."
        )
