"""Expert parallelism with ``ep_size`` smaller than the data-parallel size: ep=2 on 4 real gloo processes.

The 4 ranks form 2 ep groups of consecutive ranks ({0, 1} and {2, 3}, ep innermost as in torchtitan); each holds
every expert once, and each expert shard is replicated over the ranks with the same rank in their group ({0, 2}
holds experts 0-3 of every block, {1, 3} experts 4-7). The tiny Qwen3-MoE of
:mod:`tests.expert_parallel.test_parity` (8 experts, top-2, router aux loss on), AdamW, accumulation 2,
clipping 1.0, 10 optimizer steps, each rank one sequence of every global batch of 4:

* through the user's loop, ``Accelerator(parallelism_config=ParallelismConfig(ep_size=2))``: losses (aux loss
  included, computed over all 4 ranks' tokens), the clip's norms and parameters equal one process on the global
  batch within 1e-5; the replicas of a shard hold bitwise the same experts; each rank holds half the experts;
* by hand, ``apply_expert_parallel(model, ep_size=2)`` and ``reduce_gradients``: the same parity; without the
  replicas' all-reduce of the expert gradients it breaks (the check of this test).

One 4-process run (both loops in the same workers) for the whole module.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.expert_parallel import test_parity
from tests.expert_parallel._compare import differences
from tests.expert_parallel.accelerator_loop import MAX_NORM, train
from tests.helpers.multiprocess import run_distributed

pytestmark = pytest.mark.distributed

PROCESSES = 4
EP_SIZE = 2
TOLERANCE = 1e-5
BLOCK = "model.layers.0.mlp.experts"


def _one_process() -> dict[str, Any]:
    from lockstep import Accelerator

    return train(Accelerator(gradient_accumulation_steps=2), measure=True)


def _route_to_the_first_half(model: nn.Module, tokens: int) -> None:
    """Layer 0's router sends the first ``tokens`` tokens of each batch to experts 0-3 only (its choice modulo 4,
    weights unchanged): in ep group {0, 1}, rank 1 (experts 4-7) then receives no token of layer 0. The experts
    run transformers' "eager" loop, which computes only the experts that received tokens (the default
    "grouped_mm" touches every expert's weights, and gives zeros anyway)."""
    model.config._experts_implementation = "eager"

    def hook(module: nn.Module, args: tuple, output: tuple) -> tuple:
        logits, weights, indices = output
        forced = indices.clone()
        forced[:tokens] = indices[:tokens] % 4
        return logits, weights, forced

    model.model.layers[0].mlp.gate.register_forward_hook(hook)


def _by_hand(rank: int, sum_over_replicas: bool, idle_expert: bool = False) -> dict[str, Any]:
    """The parity test's loop with ``apply_expert_parallel(model, ep_size=2)`` on this rank's sequence; with
    ``idle_expert``, ranks 0 and 1 route layer 0's tokens to experts 0-3 only."""
    from lockstep.layers.expert_parallel import apply_expert_parallel

    model = test_parity._build("qwen3_moe")
    if idle_expert and rank < EP_SIZE:
        _route_to_the_first_half(model, test_parity.SEQUENCE)
    ep = apply_expert_parallel(model, ep_size=EP_SIZE)
    if not sum_over_replicas:  # the check of this test: each replica keeps its own ep group's gradient
        ep._sum_over_replicas = lambda: None
    rows = test_parity.GLOBAL_BATCH // PROCESSES
    result = test_parity._train(model, slice(rank * rows, (rank + 1) * rows), ep, None)
    result["first"] = {f"{name}.experts": module.first_expert for name, module in ep.experts.items()}
    result["groups"] = {
        "ep_size": ep.ep_size,
        "replicas": ep.groups.num_replicas,
        "dp": ep.data_parallel_size,
    }
    return result


def _ep2_on_four() -> dict[str, Any]:
    from lockstep import Accelerator, ParallelismConfig

    accelerator = Accelerator(
        gradient_accumulation_steps=2, parallelism_config=ParallelismConfig(ep_size=EP_SIZE)
    )
    result = train(accelerator, measure=True)
    result["distributed_type"] = str(accelerator.distributed_type)
    rank = accelerator.process_index
    result["by_hand"] = _by_hand(rank, sum_over_replicas=True)
    result["broken"] = _by_hand(rank, sum_over_replicas=False)
    result["idle_expert"] = _by_hand(rank, sum_over_replicas=True, idle_expert=True)
    result["broadcast"] = _built_apart(rank)
    return result


def _built_apart(rank: int) -> dict[str, torch.Tensor]:
    """Each rank's model built with other weights (``+ rank``), then sharded: this rank's experts."""
    from lockstep.layers.expert_parallel import apply_expert_parallel

    model = test_parity._build("qwen3_moe")
    with torch.no_grad():
        for param in model.parameters():
            param.add_(rank)
    ep = apply_expert_parallel(model, ep_size=EP_SIZE)
    expert_ids = {id(p) for p in ep.expert_parameters()}
    return {n: p.detach().clone() for n, p in model.named_parameters() if id(p) in expert_ids}


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    """The one-process references (the Accelerator's loop and the hand loop) and the 4 ranks' results."""
    (one,) = run_distributed(_one_process, 1, timeout=300.0)
    by_hand = test_parity._train(test_parity._build("qwen3_moe"), slice(None), None, None)
    routed = test_parity._build("qwen3_moe")
    _route_to_the_first_half(routed, EP_SIZE * test_parity.SEQUENCE)  # the sequences of ranks 0 and 1
    idle_expert = test_parity._train(routed, slice(None), None, None)
    ranks = run_distributed(_ep2_on_four, PROCESSES, timeout=300.0)
    return {"one": one, "by_hand": by_hand, "idle_expert": idle_expert, "ranks": ranks}


def _replicas_differ(ranks: list[dict[str, Any]]) -> float:
    """The largest difference between two replicas of an expert shard (ranks r and r + ep_size)."""
    return max(
        (ranks[r]["state"][name] - ranks[r + EP_SIZE]["state"][name]).abs().max().item()
        for r in range(PROCESSES - EP_SIZE)
        for name in ranks[r]["state"]
    )


def test_ep2_on_four_processes_through_the_accelerator_equals_one_process(runs: dict[str, Any]) -> None:
    one, ranks = runs["one"], runs["ranks"]
    assert [r["distributed_type"] for r in ranks] == ["MULTI_CPU"] * PROCESSES  # DDP trains the dense weights
    assert len(one["losses"]) == 20 and len(one["norms"]) == 10
    assert max(one["norms"]) > MAX_NORM  # the clip acts
    assert one["losses"][-1] < one["losses"][0] - 0.1  # it trained
    diff = differences(one, ranks)
    print(f"ep=2 x 2 replicas (4 processes) via Accelerator vs 1 process: {diff}")
    assert max(diff.values()) < TOLERANCE


def test_the_ep_groups_are_consecutive_ranks_and_replicas_stay_bitwise_equal(runs: dict[str, Any]) -> None:
    ranks = runs["ranks"]
    assert [r["first"][BLOCK] for r in ranks] == [0, 4, 0, 4]
    assert [r["by_hand"]["first"][BLOCK] for r in ranks] == [0, 4, 0, 4]
    assert all(r["by_hand"]["groups"] == {"ep_size": 2, "replicas": 2, "dp": 4} for r in ranks)
    # the replicas summed the same gradients and stepped the same AdamW: bitwise the same experts
    assert _replicas_differ(ranks) == 0.0
    assert _replicas_differ([r["by_hand"] for r in ranks]) == 0.0


def test_each_rank_holds_half_the_experts_and_the_whole_dense_part(runs: dict[str, Any]) -> None:
    one = runs["one"]["memory"]
    assert one["per_block"] == {"model.layers.0.mlp": 8, "model.layers.1.mlp": 8}
    for rank in runs["ranks"]:
        held = rank["memory"]
        assert held["per_block"] == {"model.layers.0.mlp": 4, "model.layers.1.mlp": 4}
        assert held["experts"]["parameter_bytes"] * 2 == one["experts"]["parameter_bytes"]
        assert held["experts"]["num_parameters"] * 2 == one["experts"]["num_parameters"]
        assert held["dense"]["parameter_bytes"] == one["dense"]["parameter_bytes"]
        # AdamW's moments halve; each of the 4 expert tensors keeps its 4-byte step counter
        assert (
            held["experts"]["optimizer_state_bytes"] - 16
            == (one["experts"]["optimizer_state_bytes"] - 16) // 2
        )
        assert held["dense"]["optimizer_state_bytes"] == one["dense"]["optimizer_state_bytes"]


def test_replicas_start_from_the_first_replica_s_experts(runs: dict[str, Any]) -> None:
    """As DDP broadcasts the dense weights from rank 0, each shard's replicas take the first replica's."""
    built = test_parity._build("qwen3_moe").state_dict()
    for rank, result in enumerate(runs["ranks"]):
        first = rank % EP_SIZE  # the first replica of this rank's shard, which built its model with + first
        rows = slice(4 * first, 4 * first + 4)
        assert result["broadcast"].keys() == {n for n in built if ".experts." in n}
        for name, tensor in result["broadcast"].items():
            assert torch.equal(tensor, built[name][rows] + first), (rank, name)


def test_apply_expert_parallel_with_ep_size_by_hand_equals_one_process(runs: dict[str, Any]) -> None:
    diff = differences(runs["by_hand"], [r["by_hand"] for r in runs["ranks"]])
    print(f"apply_expert_parallel(ep_size=2) on 4 processes vs 1 process: {diff}")
    assert max(diff.values()) < TOLERANCE


def test_an_expert_shard_without_tokens_trains_as_in_one_process(runs: dict[str, Any]) -> None:
    """Rank 1 gets no token of layer 0 and its experts' math runs none of them, its replica rank 3 does: rank 1
    still runs the backward's all-to-alls with its group and gets zero gradients, so the replicas sum the same
    tensors and AdamW steps them (weight decay) as one process."""
    diff = differences(runs["idle_expert"], [r["idle_expert"] for r in runs["ranks"]])
    print(f"an ep rank without tokens in layer 0, 4 processes vs 1 process: {diff}")
    assert max(diff.values()) < TOLERANCE
    assert _replicas_differ([r["idle_expert"] for r in runs["ranks"]]) == 0.0


def test_without_the_replicas_all_reduce_parity_breaks(runs: dict[str, Any]) -> None:
    broken = [r["broken"] for r in runs["ranks"]]
    diff = differences(runs["by_hand"], broken)
    replicas = _replicas_differ(broken)
    print(f"without the replicas' all-reduce: {diff}, replicas apart by {replicas:.3g}")
    assert diff["params"] > 50 * TOLERANCE and replicas > 50 * TOLERANCE
