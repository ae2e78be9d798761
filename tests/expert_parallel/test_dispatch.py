"""The all-to-all experts module alone, on 2 real processes with different token counts per rank.

Each rank's output, and the gradients of its hidden states and router weights, must equal the original fused
experts module (all experts, one process) on the same tokens; the sharded experts' gradients must be the sum of
both ranks' original gradients (the all-to-all backward brings every rank's tokens to the expert's owner).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from lockstep.layers.expert_parallel import ExpertParallelExperts
from lockstep.layers.expert_parallel._aux_loss import gather_rows
from tests.helpers.multiprocess import run_distributed

pytestmark = pytest.mark.distributed

HIDDEN, EXPERTS, TOP_K = 8, 4, 2


def _experts() -> Qwen3MoeExperts:
    config = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=6, num_experts=EXPERTS)
    experts = Qwen3MoeExperts(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
    return experts


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens: 3 on rank 0, 7 on rank 1, all choosing experts of rank 1 on rank 1."""
    generator = torch.Generator().manual_seed(10 + rank)
    tokens = 3 + 4 * rank
    hidden = torch.randn(tokens, HIDDEN, generator=generator, requires_grad=True)
    scores = torch.rand(tokens, EXPERTS, generator=generator)
    if rank == 1:
        scores[:, : EXPERTS // 2] = -1.0  # rank 1 sends nothing to rank 0: a zero split
    weights, index = scores.topk(TOP_K, dim=-1)
    return hidden, index, weights.requires_grad_()


def _run(experts: torch.nn.Module, rank: int) -> dict[str, Any]:
    hidden, index, weights = _inputs(rank)
    out = experts(hidden, index, weights)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    grads = {name: p.grad.clone() for name, p in experts.named_parameters()}
    return {"out": out.detach(), "hidden": hidden.grad, "weights": weights.grad, "param_grads": grads}


def _worker() -> dict[str, Any]:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    sharded = ExpertParallelExperts(_experts(), group=dist.group.WORLD, ep_rank=rank, ep_size=2)
    result = _run(sharded, rank)
    rows = torch.arange(2 + rank, dtype=torch.float32).view(-1, 1) + 10 * rank
    result["gathered"] = gather_rows(rows, dist.group.WORLD)
    result["first_expert"] = sharded.first_expert
    return result


def test_dispatch_equals_the_original_experts_on_uneven_splits() -> None:
    ranks = run_distributed(_worker, 2, timeout=120.0)
    references = [_run(copy.deepcopy(_experts()), rank) for rank in range(2)]
    for rank, (got, want) in enumerate(zip(ranks, references, strict=True)):
        for key in ("out", "hidden", "weights"):
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-5, msg=f"rank {rank} {key}")
        first = got["first_expert"]
        assert first == 2 * rank
        for name, grad in got["param_grads"].items():
            summed = sum(reference["param_grads"][name] for reference in references)
            torch.testing.assert_close(grad, summed[first : first + 2], rtol=0, atol=1e-5)
    assert ranks[0]["gathered"].flatten().tolist() == [0.0, 1.0, 10.0, 11.0, 12.0]
