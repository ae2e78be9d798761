"""Expert parallelism over 2 real gloo processes equals one process on the global batch.

Each rank trains the same tiny MoE model (transformers' own Qwen3-MoE, Mixtral, OLMoE and Qwen2-MoE with its
shared expert, built from their configs; Qwen3-MoE also with right padding, which the router's aux loss leaves
out) with its experts sharded (ep=2) on its half of every global batch: AdamW, gradient accumulation 2,
clipping 1.0, 10 optimizer steps, the router's auxiliary loss in the loss. The reference is one process on the
whole batch. Losses (aux loss included), dense parameters and each rank's expert shard must match within 1e-5.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from lockstep.layers.expert_parallel import ExpertParallel, apply_expert_parallel
from tests.helpers.multiprocess import run_distributed

pytestmark = pytest.mark.distributed

EP_SIZE = 2
STEPS = 10
ACCUMULATION = 2
GLOBAL_BATCH = 4
SEQUENCE = 8
VOCAB = 64
TOLERANCE = 1e-5
LR = 1e-3
ADAM_EPS = 1e-6
"""Adam divides each gradient element by its own running magnitude plus ``eps``, so an element whose gradient is
near zero turns rounding noise into a full-size step: Mixtral's ``layers.1.v_proj.weight[5, 31]`` has a first
gradient of 9.19e-9 on one process and 8.85e-9 over ep=2 (a difference of 1e-8 of the largest gradient), which
with the default eps 1e-8 moves it by 1e-2 * lr differently. ``eps=1e-6`` bounds that to lr * 3e-4 per step."""


def _build(kind: str) -> nn.Module:
    """A tiny MoE causal LM: 2 layers, 8 experts, top-2, router aux loss on; the same weights every call."""
    common = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "num_experts_per_tok": 2,
        "output_router_logits": True,
        "router_aux_loss_coef": 0.1,
        "max_position_embeddings": 64,
        "attn_implementation": "eager",
    }
    torch.manual_seed(0)
    if kind.startswith("qwen3_moe"):
        config = Qwen3MoeConfig(num_experts=8, moe_intermediate_size=16, intermediate_size=64, **common)
        return Qwen3MoeForCausalLM(config)
    if kind == "qwen2_moe":  # with a dense shared expert beside the routed ones
        config = Qwen2MoeConfig(
            num_experts=8, moe_intermediate_size=16, shared_expert_intermediate_size=16, **common
        )
        return Qwen2MoeForCausalLM(config)
    if kind == "deepseek_v3":  # layer 0 dense, layer 1 routed experts in 2 groups of 4 and a shared expert
        config = DeepseekV3Config(
            n_routed_experts=8,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            intermediate_size=64,
            moe_intermediate_size=16,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
            num_key_value_heads=4,  # multi-head latent attention: one key and value per head
            **{k: v for k, v in common.items() if k not in ("head_dim", "num_key_value_heads")},
        )
        return DeepseekV3ForCausalLM(config)
    if kind == "olmoe":
        return OlmoeForCausalLM(OlmoeConfig(num_experts=8, intermediate_size=16, **common))
    config = MixtralConfig(num_local_experts=8, intermediate_size=16, router_jitter_noise=0.0, **common)
    return MixtralForCausalLM(config)


def _micro_batch(index: int) -> torch.Tensor:
    """The global batch of micro-step ``index``: token ids of shape (GLOBAL_BATCH, SEQUENCE).

    Counting sequences from random starts, so that the next token is learnable and the loss falls.
    """
    generator = torch.Generator().manual_seed(100 + index)
    starts = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=generator)
    return (starts + torch.arange(SEQUENCE)) % VOCAB


def _attention_mask(kind: str) -> torch.Tensor | None:
    """For ``*_padded`` runs: row ``i`` of each global batch ends with ``i`` padding positions (right padding).

    The router's auxiliary loss leaves padding out, so each rank's share of it differs from the global one; the
    cross-entropy still counts every position (labels are not masked), so its mean of means stays the global
    mean and only the aux loss tells the mask's handling apart.
    """
    if not kind.endswith("_padded"):
        return None
    return (torch.arange(SEQUENCE) < SEQUENCE - torch.arange(GLOBAL_BATCH).unsqueeze(1)).long()


def _train(
    model: nn.Module, rows: slice, ep: ExpertParallel | None, mask: torch.Tensor | None
) -> dict[str, Any]:
    """10 optimizer steps on ``rows`` of every global batch; the per-micro-step losses and final weights."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS)
    losses, aux_losses = [], []
    for step in range(STEPS):
        for micro in range(ACCUMULATION):
            ids = _micro_batch(step * ACCUMULATION + micro)[rows]
            out = model(input_ids=ids, labels=ids, attention_mask=None if mask is None else mask[rows])
            (out.loss / ACCUMULATION).backward()
            losses.append(out.loss.item())
            aux_losses.append(0.0 if out.aux_loss is None else out.aux_loss.item())  # DeepSeek-V3: none
        if ep is not None:
            ep.reduce_gradients()
            ep.clip_grad_norm_(1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    return {"losses": losses, "aux": aux_losses, "state": state}


def _ep_worker(kind: str) -> dict[str, Any]:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = _build(kind)
    ep = apply_expert_parallel(model)
    per_rank = GLOBAL_BATCH // EP_SIZE
    result = _train(model, slice(rank * per_rank, (rank + 1) * per_rank), ep, _attention_mask(kind))
    result["first_expert"] = {name: module.first_expert for name, module in ep.experts.items()}
    result["expert_bytes"] = sum(p.numel() * p.element_size() for p in ep.expert_parameters())
    result["dense_bytes"] = sum(p.numel() * p.element_size() for p in ep.dense_parameters())
    # the original experts modules, kept to compute, hold only this rank's shard: the full tensors are released
    kept = {id(p): p for module in ep.experts.values() for p in module._local_math[0].parameters()}
    result["kept_bytes"] = sum(p.numel() * p.element_size() for p in kept.values())
    return result


def _expert_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)


@pytest.fixture(
    scope="module", params=["qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe_padded", "deepseek_v3"]
)
def runs(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The one-process reference and the ep=2 ranks' results, trained once per model kind."""
    kind = request.param
    reference_model = _build(kind)
    expert_bytes = _expert_bytes(reference_model)
    dense_bytes = sum(p.numel() * p.element_size() for p in reference_model.parameters()) - expert_bytes
    reference = _train(reference_model, slice(None), None, _attention_mask(kind))
    ranks = run_distributed(_ep_worker, EP_SIZE, kind, timeout=300.0)
    return {
        "kind": kind,
        "reference": reference,
        "ranks": ranks,
        "expert_bytes": expert_bytes,
        "dense_bytes": dense_bytes,
    }


def _local_shard(name: str, full: torch.Tensor, rank: dict[str, Any]) -> torch.Tensor:
    """The rows of the reference's expert tensor ``name`` that ``rank`` holds."""
    block = name.rsplit(".experts.", 1)[0]
    first = rank["first_expert"][block]
    return full[first : first + full.shape[0] // EP_SIZE]


def test_losses_equal_one_process(runs: dict[str, Any]) -> None:
    reference = runs["reference"]
    losses = torch.tensor([r["losses"] for r in runs["ranks"]]).mean(dim=0)
    assert len(losses) == STEPS * ACCUMULATION
    loss_diff = (losses - torch.tensor(reference["losses"])).abs().max().item()
    aux_diff = max(
        (torch.tensor(r["aux"]) - torch.tensor(reference["aux"])).abs().max().item() for r in runs["ranks"]
    )
    print(f"{runs['kind']}: max loss diff {loss_diff:.3g}, max aux loss diff {aux_diff:.3g}")
    assert loss_diff < TOLERANCE
    assert aux_diff < TOLERANCE
    # the model trained: a loss that did not move would match trivially
    assert reference["losses"][-1] < reference["losses"][0] - 0.1


def test_parameters_equal_one_process(runs: dict[str, Any]) -> None:
    reference = runs["reference"]["state"]
    worst = 0.0
    for rank in runs["ranks"]:
        assert rank["state"].keys() == reference.keys()
        for name, full in reference.items():
            expected = _local_shard(name, full, rank) if ".experts." in name else full
            assert rank["state"][name].shape == expected.shape, name
            worst = max(worst, (rank["state"][name] - expected).abs().max().item())
    print(f"{runs['kind']}: max parameter diff {worst:.3g}")
    assert worst < TOLERANCE
    # the parameters moved: 10 AdamW steps change every weight by far more than the tolerance
    initial = _build(runs["kind"]).state_dict()
    moved = max((reference[n] - initial[n]).abs().max().item() for n in reference if "experts" in n)
    assert moved > 100 * TOLERANCE


def test_expert_bytes_per_rank_are_one_over_ep(runs: dict[str, Any]) -> None:
    for rank in runs["ranks"]:
        assert rank["expert_bytes"] * EP_SIZE == runs["expert_bytes"]
        assert rank["kept_bytes"] == rank["expert_bytes"]
        assert rank["dense_bytes"] == runs["dense_bytes"]
    assert runs["expert_bytes"] > runs["dense_bytes"] / 4  # the experts are a real share of the model
