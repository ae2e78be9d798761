"""Expert parallelism: a mixture-of-experts model's experts sharded over ranks, tokens routed by all-to-all.

What it does. :func:`apply_expert_parallel` finds the model's sparse-MoE blocks (transformers 5.x Qwen3-MoE,
Mixtral, OLMoE, Qwen2-MoE, DeepSeek-V3, and any block recognised with :func:`register_moe_block`), keeps on rank ``r`` of
an expert-parallel group of size ``ep`` the experts ``[r * E / ep, (r + 1) * E / ep)`` of each block as plain
local parameters, and swaps the block's experts module for one that sends each of this rank's (token, choice)
pairs to the rank holding the chosen expert (``all_to_all_single`` of the counts, then of the hidden states,
uneven splits), runs the model's own expert math there, sends the results back and combines them with the
router's top-k weights as the block does. The model's forward, router and expert math are unchanged. The
router's auxiliary load-balancing loss is computed over every data-parallel rank's tokens, as one process
computes it. :meth:`ExpertParallel.reduce_gradients` averages dense gradients over the ranks and the expert
gradients the same way, so that training equals one process on the global batch (tested within 1e-6 on 2
processes: Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE, DeepSeek-V3; AdamW, accumulation, clipping, padding).

Groups (:mod:`lockstep.layers.expert_parallel._groups`). ``ep_size`` divides the data-parallel size ``W`` and
is its inner factor, as in torchtitan: the ranks form ``W / ep_size`` ep groups of ``ep_size`` consecutive
ranks (``[0, ep)``, ``[ep, 2 ep)``, ...), each holding every expert once and routing its own ranks' tokens
among them; each expert shard is replicated over the ranks with the same rank in their ep group
(``{e, e + ep, e + 2 ep, ...}``, the replica group). An expert gradient (the sum over its ep group's tokens) is
summed over its replicas and divided by ``W``, as the dense ones are averaged over all ``W`` ranks; the
router's aux loss is gathered over all ``W`` ranks; the clip's norm sums the expert part over the ep group
only (each shard once, not once per replica); a checkpoint gathers each ep group's experts (every group
gathers the same one-process layout). With ``ep_size == W`` there is one ep group and no replica group. The
groups are created once, on every rank in the same order (``torch.distributed.new_group``), after the checks.

Why plain local parameters, not a DTensor ``Shard(0)``: the model's expert math indexes its 3-D parameters
by local expert and must run on this rank's shard only; FSDP2 shards these local parameters over the ranks
that hold the same experts, a different mesh from the dense parameters', which a DTensor placed on the ``ep``
mesh would first have to be unwrapped from.

With FSDP2 (:mod:`lockstep.layers.expert_parallel._fsdp`). ``ParallelismConfig(dp_shard_size=N, ep_size=E)``
(``E`` dividing ``N``, the N-D backend): the same ep groups; each experts module is ``fully_shard``-ed over its
replica group (the ``N / E`` ranks holding the same experts, torchtitan's ``dp_shard_mod_ep``; one rank when
``E == N``) by the backend's :class:`~lockstep.backends.capabilities.SeparateSharding` before the backend
shards the dense weights over all ``N`` ranks; FSDP2 reduce-scatters the expert gradients over the replicas and
divides them by ``N`` (``set_gradient_divide_factor``), its ``set_requires_gradient_sync`` (accumulation)
covers them, and the clip sums every rank's local squares once over the world (each element is held by one
rank). Checked against one process (``tests/expert_parallel/test_fsdp.py``): ``E = 2`` with ``N = 2`` and
``N = 4``, within 1e-6. Checkpoints hold the one-process layout there too (below): before saving, each rank's
experts are gathered over its replica group (``full_tensor()``) and then over its ep group, so that every ep
group offers the same whole tensors to FSDP2's sharded checkpoint (``torch.distributed.checkpoint`` writes them
once, under the one-process names); before loading, the experts' state dicts hold tensors of the one-process
shape for DCP to read into, and the load pre-hooks keep this rank's rows sharded over its replica group as
FSDP2 holds them (``tests/expert_parallel/test_fsdp_checkpoint.py``: ``N = 2`` and ``N = 4``, to and from one
process and resumed, bitwise).

Under the Accelerator (a layer: :mod:`lockstep.layers.expert_parallel._layer`, turned on by the layout).
``Accelerator(parallelism_config=ParallelismConfig(ep_size=N))``, the config file's
``parallelism_config_ep_size`` or ``lockstep launch --parallelism-config-ep-size N`` shards the experts of every
model ``prepare`` gets for training over ep groups of ``N`` processes (``N`` dividing the processes), before DDP
wraps it; DDP averages the dense gradients and leaves the experts out; the layer's step hooks sum the expert
gradients over their replicas and divide them by the number of processes once per optimizer step (also with
``accelerator.accumulate``) and make ``accelerator.clip_grad_norm_`` use the norm over every expert once.

Checkpoints hold the layout one process has (:mod:`lockstep.layers.expert_parallel._checkpoint`).
``save_state``, ``save_model`` and ``get_state_dict`` write the unswapped model's own keys and shapes (every
block's ``E`` experts under the original parameter names) and, for ``save_state``, the optimizer state one
process has (the expert parameters' Adam moments with all ``E`` rows, under the same parameter indices):
the layer's ``before_checkpoint`` all-gathers the experts of every rank of the ep group and their optimizer
states, and torch's
state-dict post-hooks of the experts modules and of the prepared optimizer put them in. ``load_state`` (and
any ``load_state_dict`` of the model or the optimizer) takes this rank's rows out of that layout in the load
pre-hooks, so a checkpoint saved on ``ep=2`` loads on one process, on ``ep=2`` and on ``ep=4``, and one saved
on one process loads on ``ep=2``; one saved on ``ep=2`` over 4 processes (2 replicas) loads on one process, and
checkpoints of one process and of ``ep=2`` on 2 load there: parameters and Adam moments bitwise equal, and an
``ep=2`` run resumes bitwise-exactly (``tests/expert_parallel/test_checkpoint.py``). ``save_model``'s folder loads into the
one-process model with ``load_state_dict(strict=True)`` and, with the model's config, ``from_pretrained``.
Every process calls ``save_state``, ``save_model`` and ``get_state_dict`` together (the gathering is a
collective); a plain ``model.state_dict()`` or ``optimizer.state_dict()`` outside them gives this rank's shard
and never communicates.

The Trainer. ``TrainingArguments(parallelism_config=ParallelismConfig(ep_size=N))`` (or ``{"ep_size": N}``)
trains as the Trainer does on one process on the same global batch (``tests/expert_parallel/test_trainer.py``: ``ep=2`` on 2 and on 4 processes),
its checkpoints resume and ``save_model`` writes the one-process model. The Trainer multiplies each rank's loss
by the replicas when it normalises by the whole step's tokens (``num_items_in_batch``); the layer is the
:class:`~lockstep.backends.GlobalLossTerm` capability the Trainer tells so (:class:`LossMultiplier`), and the global aux loss,
added by every rank, then counts once.

Memory (:mod:`lockstep.layers.expert_parallel._memory`). :func:`expert_memory` measures a rank's experts apart
from its dense part (each rank: ``num_experts / ep_size`` experts per block, their gradients and optimizer
state; the dense part whole; under FSDP2 with ``dp_shard_size=N``, the DTensors' local shards: ``1 / N`` of the
dense part and of the experts' rows); ``lockstep estimate-memory --ep-size N`` predicts them, with ``--dp-shard M``
for FSDP2 (:func:`count_experts` counts the model's expert elements; the formula lives with the other strategies'
in :func:`lockstep.memory.estimate.formulas.expert_parallel_model_state_bytes`), equal to the measured bytes
(``tests/expert_parallel/test_memory.py``: ``ep=2`` and ``dp_shard=2 x ep=2`` on 2 processes;
``test_fsdp.py``: ``dp_shard=4 x ep=2`` on 4, each rank's experts over 2 replicas).

Built: the engine above; under the Accelerator, expert parallelism borrowed from plain data parallelism (DDP)
with any ``ep_size`` dividing the number of processes: equal to it (checked against one process on the global
batch through the user's loop and through ``lockstep launch``, 2 processes) or smaller, the experts replicated
over ``processes / ep_size`` ep groups (``ep=2`` on 4 processes through the user's loop, by hand with
``apply_expert_parallel(model, ep_size=2)`` and through the Trainer: ``tests/expert_parallel/test_replicas.py``,
``test_trainer.py``); checkpoints, as above. Composed with FSDP2 (``dp_shard_size``), as above, through the
user's loop (``dp_shard_size`` 2 and 4 with ``ep_size=2``) and the Trainer (``dp_shard_size=2``: its step-2
checkpoint resumes bitwise, from other weights, and ``save_model``'s folder loads with ``from_pretrained`` in one
process bitwise; ``tests/expert_parallel/test_fsdp.py``), with checkpoints as above.

Not built yet (next, each refused by name before the first step): composition with HSDP, TP, CP and pipeline
parallelism (``ParallelismConfig`` refuses them), and with DeepSpeed;
``apply_expert_parallel(group=..., ep_size=...)`` with ``ep_size`` smaller than a group other than the world.
Checkpoints of an optimizer whose state of an expert parameter is not shaped like the parameter (Adafactor's
factored moments) are refused by ``save_state`` before it writes anything (:class:`ExpertParallelNotBuiltError`);
``save_model`` still works. A ``save_state`` between the micro-steps of gradient accumulation keeps each
process's pending gradients in its own shard's shape: it resumes on the same ``ep_size`` only (on another,
putting the gradients back fails with torch's size error). Passing an already-distributed model or a
multi-dimensional mesh to :func:`apply_expert_parallel` raises :class:`ExpertParallelNotBuiltError`.

Example:
    >>> from lockstep import Accelerator, ParallelismConfig
    >>> accelerator = Accelerator(parallelism_config=ParallelismConfig(ep_size=2))  # doctest: +SKIP
    >>> model, optimizer, loader = accelerator.prepare(model, optimizer, loader)  # doctest: +SKIP

    Or by hand, without the Accelerator:

    >>> from lockstep.layers.expert_parallel import apply_expert_parallel
    >>> ep = apply_expert_parallel(model, ep_size=2)  # ep groups of 2 consecutive ranks  # doctest: +SKIP
    >>> loss = model(input_ids=ids, labels=ids).loss  # doctest: +SKIP
    >>> loss.backward(); ep.reduce_gradients(); ep.clip_grad_norm_(1.0); optimizer.step()  # doctest: +SKIP
"""

from lockstep._lazy import lazy_exports

# Lazy, so that the launcher reads ``spec`` without importing torch (every layer folder stays torch-free).
_PACKAGE = "lockstep.layers.expert_parallel"
__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "ExpertParallel": f"{_PACKAGE}._apply",
        "ExpertParallelExperts": f"{_PACKAGE}._dispatch",
        "ExpertParallelGroups": f"{_PACKAGE}._groups",
        "ExpertParallelLayer": f"{_PACKAGE}._layer",
        "ExpertParallelNotBuiltError": f"{_PACKAGE}._errors",
        "ExpertShardingError": f"{_PACKAGE}._errors",
        "ExpertCount": f"{_PACKAGE}._memory",
        "ExpertMemory": f"{_PACKAGE}._memory",
        "LossMultiplier": f"{_PACKAGE}._aux_loss",
        "MoEBlock": f"{_PACKAGE}._blocks",
        "MoEModelNotSupportedError": f"{_PACKAGE}._errors",
        "apply_expert_parallel": f"{_PACKAGE}._apply",
        "count_experts": f"{_PACKAGE}._memory",
        "expert_parallel_groups": f"{_PACKAGE}._groups",
        "expert_memory": f"{_PACKAGE}._memory",
        "find_moe_blocks": f"{_PACKAGE}._blocks",
        "global_load_balancing_loss": f"{_PACKAGE}._aux_loss",
        "recognised_blocks": f"{_PACKAGE}._blocks",
        "register_moe_block": f"{_PACKAGE}._blocks",
    },
)
