"""The chunked loss over an ``lm_head`` whose vocabulary is split over tensor-parallel ranks (``loss_parallel``).

Under tensor parallelism transformers' plan shards ``lm_head`` column-wise (``colwise_gather_output``): each
rank holds the weight rows of a slice of the vocabulary, as a DTensor ``Shard(0)``, and its forward gathers the
logits. The chunked loss instead projects each chunk onto this rank's slice only and combines the slices with
three all-reduces of one float per position (the maximum, the sum of exponentials, the target logit); backward
sums the hidden states' gradient over the ranks. No rank ever holds the logits of the whole vocabulary.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

TENSOR_PARALLEL_DIM = "tp"
"""The name of the mesh dimension over which tensor parallelism splits ``lm_head`` (lockstep's and
transformers' meshes)."""


class VocabShard(NamedTuple):
    """This rank's slice of the vocabulary: rows ``offset`` to ``offset + local rows`` of the weight."""

    group: dist.ProcessGroup
    offset: int


def local_projection(
    weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None, VocabShard | None]:
    """``(weight, bias, None)`` for a whole weight; for a DTensor split by vocabulary rows, this rank's rows
    (through ``to_local``, so that their gradient reaches the DTensor parameter) and its slice.

    Raises:
        NotImplementedError: a DTensor laid out otherwise than ``Shard(0)`` on a 1-D ``"tp"`` mesh (FSDP's
            shards of a whole weight, a 2-D layout).
    """
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(weight, DTensor):
        return weight, bias, None
    mesh, placements = weight.device_mesh, tuple(weight.placements)
    # FSDP2 leaves the same Shard(0) layout after the forward, on an unnamed data-parallel mesh whose ranks hold
    # other tokens: only tensor parallelism's "tp" mesh splits one vocabulary over ranks that share the tokens.
    if mesh.mesh_dim_names != (TENSOR_PARALLEL_DIM,) or placements != (Shard(0),):
        raise NotImplementedError(
            f"chunked_causal_lm_loss: the lm_head weight is a DTensor placed {placements} on a mesh of "
            f"dimensions {mesh.mesh_dim_names}; the chunked loss takes a whole weight or one split by vocabulary "
            f"rows over a tensor-parallel mesh (Shard(0) on a 1-D mesh named {TENSOR_PARALLEL_DIM!r}). FSDP's "
            "shards and other layouts are not built yet: use the model's own loss there."
        )
    vocab, ranks = weight.shape[0], mesh.size()
    per_rank = -(-vocab // ranks)  # torch.chunk's split, as Shard(0) lays the rows out
    offset = min(mesh.get_local_rank() * per_rank, vocab)
    local = weight.to_local()
    assert local.shape[0] == min(per_rank, vocab - offset), (tuple(local.shape), vocab, ranks)
    if isinstance(bias, DTensor):
        bias = bias.to_local()
    elif bias is not None:
        bias = bias[offset : offset + local.shape[0]]
    return local, bias, VocabShard(mesh.get_group(), offset)


def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType, shard: VocabShard | None) -> torch.Tensor:
    """``tensor`` reduced in place over the vocabulary's ranks (nothing without a split)."""
    if shard is not None:
        dist.all_reduce(tensor, op=op, group=shard.group)
    return tensor


def local_targets(
    targets: torch.Tensor, rows: int, shard: VocabShard | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The targets as columns of this rank's logits (clamped into range), and which of them this rank holds
    (None: all)."""
    if shard is None:
        return targets, None
    local = targets - shard.offset
    held = (local >= 0) & (local < rows)
    return local.clamp(0, max(rows - 1, 0)), held
