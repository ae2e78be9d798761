"""Bad input to expert parallelism: one named error, raised before any collective, that says what to do."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from lockstep.layers.expert_parallel import (
    ExpertParallelNotBuiltError,
    ExpertShardingError,
    MoEModelNotSupportedError,
    _blocks,
    apply_expert_parallel,
    recognised_blocks,
    register_moe_block,
)
from tests.expert_parallel.test_parity import _build
from tests.helpers.multiprocess import run_distributed


class _UnfusedBlock(nn.Module):
    """A block shaped like a sparse-MoE block, but with a list of per-expert MLPs."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.experts.num_experts = 2


def test_a_model_without_moe_block_is_refused() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(MoEModelNotSupportedError, match=r"found no mixture-of-experts block in Sequential"):
        apply_expert_parallel(model)


def test_the_recognised_table_names_the_transformers_blocks() -> None:
    assert {"Qwen3MoeSparseMoeBlock", "MixtralSparseMoeBlock", "OlmoeSparseMoeBlock"} <= set(
        recognised_blocks()
    )


def test_a_registered_block_without_fused_experts_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_blocks, "_RECOGNISED_BLOCKS", dict(_blocks._RECOGNISED_BLOCKS))
    register_moe_block(_UnfusedBlock)
    assert recognised_blocks()["_UnfusedBlock"] == "experts"
    with pytest.raises(MoEModelNotSupportedError, match=r"'0' \(_UnfusedBlock\) is recognised.*not a fused"):
        apply_expert_parallel(nn.Sequential(_UnfusedBlock()))


def test_no_process_group_is_a_wrong_order_error() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"needs an initialized process group"):
        apply_expert_parallel(_build("qwen3_moe"))


def _bad_inputs_worker() -> dict[str, str]:
    dist.init_process_group("gloo")
    messages = {}
    for case in ("indivisible", "ep_size", "subgroup", "mesh_2d", "ddp"):
        model = _build("qwen3_moe")
        try:
            if case == "indivisible":
                apply_expert_parallel(model)  # 8 experts over 3 ranks
            elif case == "ep_size":
                apply_expert_parallel(model, ep_size=2)  # ep groups of 2 out of 3 ranks
            elif case == "subgroup":  # ep groups carved out of a group that is not the world
                apply_expert_parallel(model, dist.new_group([0, 1, 2]), ep_size=1)
            elif case == "mesh_2d":
                apply_expert_parallel(model, init_device_mesh("cpu", (3, 1), mesh_dim_names=("dp", "ep")))
            else:
                apply_expert_parallel(nn.parallel.DistributedDataParallel(model))
        except (ExpertShardingError, ExpertParallelNotBuiltError) as error:
            messages[case] = f"{type(error).__name__}: {error}"
        # every expert tensor is whole: the refusal came before anything was sharded
        assert all(p.shape[0] == 8 for n, p in model.named_parameters() if ".experts." in n)
    return messages


def test_indivisible_experts_and_unbuilt_compositions_are_refused() -> None:
    for messages in run_distributed(_bad_inputs_worker, 3, timeout=120.0):
        assert messages["indivisible"].startswith(
            "ExpertShardingError: expert parallelism over 3 ranks cannot"
        )
        assert (
            "split the 8 experts of 'model.layers.0.mlp' (Qwen3MoeSparseMoeBlock)" in messages["indivisible"]
        )
        assert "Use an ep_size that divides 8." in messages["indivisible"]
        assert messages["ep_size"] == (
            "ExpertShardingError: expert parallelism with ep_size=2 does not fit 3 data-parallel ranks: the "
            "ranks form groups of ep_size consecutive ranks, so ep_size must divide 3. Pass an ep_size that "
            "divides 3."
        )
        assert messages["subgroup"].startswith(
            "ExpertParallelNotBuiltError: expert parallelism with ep_size=1 over a data-parallel group of 3 of "
            "the 3 processes is not built"
        )
        assert messages["mesh_2d"].startswith("ExpertParallelNotBuiltError: apply_expert_parallel(group=<2-D")
        assert "composing expert parallelism with them is not built yet" in messages["ddp"]


def _tuple_output_worker() -> str:
    dist.init_process_group("gloo")
    model = _build("qwen3_moe")
    apply_expert_parallel(model)
    ids = torch.arange(8).view(1, 8)
    assert model(input_ids=ids, labels=ids, output_router_logits=False, return_dict=False)[0].ndim == 0
    with pytest.raises(ExpertParallelNotBuiltError) as raised:
        model(input_ids=ids, labels=ids, return_dict=False)
    return str(raised.value)


def test_a_tuple_output_with_router_logits_is_refused() -> None:
    for message in run_distributed(_tuple_output_worker, 2, timeout=120.0):
        assert message.startswith(
            "Qwen3MoeForCausalLM(..., return_dict=False) with output_router_logits under"
        )
        assert "Call the model with return_dict=True" in message
