"""Expert parallelism: a mixture-of-experts model's experts sharded over ranks, tokens routed by all-to-all.

What it does. :func:`apply_expert_parallel` finds the model's sparse-MoE blocks (transformers 5.x Qwen3-MoE,
Mixtral, OLMoE, Qwen2-MoE, and any block recognised with :func:`register_moe_block`), keeps on rank ``r`` of
an expert-parallel group of size ``ep`` the experts ``[r * E / ep, (r + 1) * E / ep)`` of each block as plain
local parameters, and swaps the block's experts module for one that sends each of this rank's (token, choice)
pairs to the rank holding the chosen expert (``all_to_all_single`` of the counts, then of the hidden states,
uneven splits), runs the model's own expert math there, sends the results back and combines them with the
router's top-k weights as the block does. The model's forward, router and expert math are unchanged. The
router's auxiliary load-balancing loss is computed over every rank's tokens, as one process computes it.
:meth:`ExpertParallel.reduce_gradients` averages dense gradients over the ranks and scales expert gradients
the same way, so that training equals one process on the global batch (tested within 1e-6 on 2 processes:
Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE; AdamW, accumulation, clipping, padding).

Why plain local parameters, not a DTensor ``Shard(0)``: the model's expert math indexes its 3-D parameters
by local expert and must run on this rank's shard only; FSDP2 (next) will shard these local parameters over
the ranks that hold the same experts, a different mesh from the dense parameters', which a DTensor placed
on the ``ep`` mesh would first have to be unwrapped from.

Built: the engine above, for expert parallelism borrowed from data parallelism over one group (every rank
of the group feeds its own batch; no DDP around the model).

Not built yet (next): ``ep_size`` in ``ParallelismConfig``, the config file, the launch flags and the
Trainer; composition with FSDP2, TP and HSDP (experts replicated over part of the data-parallel world);
checkpoints that reshard over ``ep``; ``memory_accounting`` of experts. Passing an already-distributed model
or a multi-dimensional mesh raises :class:`ExpertParallelNotBuiltError`.

Example:
    >>> from lockstep.expert_parallel import apply_expert_parallel
    >>> ep = apply_expert_parallel(model)  # doctest: +SKIP
    >>> loss = model(input_ids=ids, labels=ids).loss  # doctest: +SKIP
    >>> loss.backward(); ep.reduce_gradients(); ep.clip_grad_norm_(1.0); optimizer.step()  # doctest: +SKIP
"""

from lockstep.expert_parallel._apply import ExpertParallel, apply_expert_parallel
from lockstep.expert_parallel._aux_loss import global_load_balancing_loss
from lockstep.expert_parallel._blocks import MoEBlock, find_moe_blocks, recognised_blocks, register_moe_block
from lockstep.expert_parallel._dispatch import ExpertParallelExperts
from lockstep.expert_parallel._errors import (
    ExpertParallelNotBuiltError,
    ExpertShardingError,
    MoEModelNotSupportedError,
)

__all__ = [
    "ExpertParallel",
    "ExpertParallelExperts",
    "ExpertParallelNotBuiltError",
    "ExpertShardingError",
    "MoEBlock",
    "MoEModelNotSupportedError",
    "apply_expert_parallel",
    "find_moe_blocks",
    "global_load_balancing_loss",
    "recognised_blocks",
    "register_moe_block",
]
