"""The expert-parallel experts module: route each rank's tokens to the rank that holds their experts, and back.

:class:`ExpertParallelExperts` replaces a fused experts module inside its block (a module swap: the block's
forward, the router and the experts' math stay the model's). Rank ``r`` of an expert-parallel group of size
``ep`` keeps experts ``[r * E / ep, (r + 1) * E / ep)`` as plain local parameters under the original names
(``gate_up_proj``, ``down_proj``), so the block calls it exactly as it called the original::

    pairs       every (token, k) of this rank, sorted by expert -> grouped by the rank that holds the expert
    counts      all_to_all_single of the pair counts per destination rank (uneven splits)
    dispatch    all_to_all_single of the pairs' hidden states (autograd), and of their local expert ids
    compute     the original experts module, on the received rows, with top_k = 1 and weight 1
    return      all_to_all_single of the results back to the ranks the tokens came from (autograd)
    combine     results put back in (token, k) order, times the top-k weights, summed over k
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import _functional_collectives as funcol


def _exchange(
    rows: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """``all_to_all_single`` of ``rows`` through which autograd flows.

    torch's functional collective is used, rather than an autograd Function written here: in torch 2.13 it
    carries its own backward (the same exchange with the splits swapped), it runs on gloo and NCCL alike, and
    ``torch.distributed.nn.functional.all_to_all_single`` is deprecated in its favour.
    """
    output = funcol.all_to_all_single(rows.contiguous(), output_splits, input_splits, group)
    return funcol.wait_tensor(output)


class ExpertParallelExperts(nn.Module):
    """This rank's share of a fused experts module, with all-to-all token dispatch and combine.

    Attributes:
        num_experts: the experts of the whole block (over every rank).
        num_local_experts: the experts this rank holds.
        first_expert: the global index of this rank's first expert.
    """

    def __init__(self, experts: nn.Module, *, group: dist.ProcessGroup, ep_rank: int, ep_size: int) -> None:
        """Take this rank's experts out of ``experts`` (whose full parameters are then released).

        Args:
            experts: the block's fused experts module; its class's forward computes the local experts.
            group: the expert-parallel process group.
            ep_rank: this process's rank in ``group``.
            ep_size: the size of ``group``; it divides ``experts.num_experts`` (checked by the caller).
        """
        super().__init__()
        self.num_experts = int(experts.num_experts)
        self.num_local_experts = self.num_experts // ep_size
        self.first_expert = ep_rank * self.num_local_experts
        self.ep_size = ep_size
        self._group = group
        last = self.first_expert + self.num_local_experts
        for name, param in list(experts.named_parameters(recurse=False)):
            local = nn.Parameter(param.detach()[self.first_expert : last].clone(), param.requires_grad)
            self.register_parameter(name, local)
            setattr(experts, name, local)  # the full tensor is released; the module only computes now
        experts.num_experts = self.num_local_experts
        # Held outside the module tree (a tuple is not registered), so the parameters appear once, under the
        # original names; its forward is called with this module's current parameters (functional_call), so
        # whoever replaces them later (FSDP2) is what the math reads.
        self._local_math: tuple[nn.Module] = (experts,)

    def parameters_replaced(self) -> None:
        """Point the model's expert math at this module's current parameters, after FSDP2 replaced them by its
        sharded ones, so that the replaced tensors are released (the math reads this module's parameters at
        every forward anyway)."""
        (math,) = self._local_math
        for name, param in self.named_parameters(recurse=False):
            setattr(math, name, param)

    def extra_repr(self) -> str:
        """The shard this rank holds."""
        last = self.first_expert + self.num_local_experts
        return f"experts [{self.first_expert}, {last}) of {self.num_experts}, ep_size={self.ep_size}"

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """The block's output for this rank's tokens, computed by whichever ranks hold their experts.

        Args:
            hidden_states: ``(tokens, hidden)``, this rank's tokens.
            top_k_index: ``(tokens, top_k)``, the global expert index of each token's choices.
            top_k_weights: ``(tokens, top_k)``, the router's weights for those choices.
        """
        tokens, top_k = top_k_index.shape
        flat_expert = top_k_index.reshape(-1)
        # Stable sort by expert: experts of one rank are contiguous, so the pairs come grouped by destination.
        order = torch.argsort(flat_expert, stable=True)
        sorted_expert = flat_expert[order]
        send_counts = torch.bincount(sorted_expert // self.num_local_experts, minlength=self.ep_size)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self._group)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()

        received = _exchange(hidden_states[order // top_k], recv_splits, send_splits, self._group)
        received_expert = sorted_expert.new_empty(sum(recv_splits))
        dist.all_to_all_single(
            received_expert,
            sorted_expert % self.num_local_experts,
            output_split_sizes=recv_splits,
            input_split_sizes=send_splits,
            group=self._group,
        )
        computed = self._compute(received, received_expert, top_k_weights.dtype)
        if computed.shape[0] == 0 and torch.is_grad_enabled() and not computed.requires_grad:
            computed = self._in_the_graph(computed, received)
        returned = _exchange(computed, send_splits, recv_splits, self._group)

        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        per_choice = returned[inverse].view(tokens, top_k, -1)
        # The original multiplies each expert's output by its weight, then adds the k outputs into zeros.
        combined = (per_choice * top_k_weights.unsqueeze(-1)).sum(dim=1)
        return combined.to(hidden_states.dtype)

    def _in_the_graph(self, computed: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
        """``computed`` (no rows) tied by a zero term to the received rows and this rank's experts.

        A rank that received no token skips every expert in the model's own math (transformers' "eager" experts
        loop runs only the experts hit), so its empty result needs no gradient: its backward would then leave
        out the two all-to-alls that the other ranks of the group run in theirs (a hang, or a crash when it
        exits), and its experts would get no gradient where one process has zeros (which AdamW steps: weight
        decay), nor one to sum with their replicas'.
        """
        tie = received.sum() * 0
        for param in self.parameters(recurse=False):
            if param.requires_grad:
                tie = tie + param.sum() * 0
        return computed + tie.to(computed.dtype)

    def _compute(self, rows: torch.Tensor, local_expert: torch.Tensor, weight_dtype: torch.dtype) -> Any:
        """The model's own experts forward on the received rows: one choice each, of weight 1."""
        (math,) = self._local_math
        ones = torch.ones((rows.shape[0], 1), dtype=weight_dtype, device=rows.device)
        params = dict(self.named_parameters(recurse=False))
        return torch.func.functional_call(math, params, (rows, local_expert.unsqueeze(1), ones))
