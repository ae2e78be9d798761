"""Memory as promised: under ``ParallelismConfig(ep_size=2)`` each rank holds ``num_experts / 2`` experts per
block (their parameters, gradients and AdamW moments: half of one process's bytes) and the whole dense part;
under ``ParallelismConfig(dp_shard_size=2, ep_size=2)`` (FSDP2, in the same 2 processes) half of the dense part
too; ``lockstep estimate-memory --ep-size 2`` (with ``--dp-shard 2`` for FSDP2) predicts those bytes exactly
(AdamW's step counters aside), and refuses, with exit code 2, an ``--ep-size`` that does not divide the experts,
a ``--dp-shard`` it does not divide, a layout it does not compose with, or a model without experts.

The tiny Qwen3-MoE of :mod:`tests.expert_parallel.test_parity` (2 layers, 8 experts, fp32), one AdamW step
under the Accelerator; the measurement is :func:`lockstep.memory_accounting.account_memory` and
:func:`lockstep.layers.expert_parallel.expert_memory`.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from tests.expert_parallel.test_parity import ADAM_EPS, GLOBAL_BATCH, LR, _build, _micro_batch
from tests.helpers.cli import lockstep_in_process
from tests.helpers.multiprocess import run_distributed

pytestmark = pytest.mark.distributed

EXPERT_ROWS = ("gate_up_proj", "down_proj")


def _held(ep_size: int, dp_shard: int = 1) -> dict[str, Any]:
    """One AdamW step of the tiny Qwen3-MoE (under FSDP2 with ``dp_shard > 1``); the bytes this rank holds, in
    all and experts apart."""
    from lockstep import Accelerator, ParallelismConfig
    from lockstep.layers.expert_parallel import expert_memory
    from lockstep.memory_accounting import account_memory

    config = None
    if ep_size > 1:
        sizes = {"dp_shard_size": dp_shard} if dp_shard > 1 else {}
        config = ParallelismConfig(ep_size=ep_size, **sizes)
    accelerator = Accelerator(parallelism_config=config)
    model = _build("qwen3_moe")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS)
    model, optimizer = accelerator.prepare(model, optimizer)
    rows = GLOBAL_BATCH // accelerator.num_processes
    ids = _micro_batch(0)[accelerator.process_index * rows : (accelerator.process_index + 1) * rows]
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    optimizer.step()  # before zero_grad: parameters, gradients and moments all exist
    unwrapped = accelerator.unwrap_model(model)
    parts = expert_memory(unwrapped, optimizer)
    steps = sum(s["step"].nbytes for s in optimizer.state.values())  # AdamW's fp32 step counters
    return {
        "all": account_memory(model, optimizer).as_dict(),
        "experts": parts.experts.as_dict(),
        "dense": parts.dense.as_dict(),
        "per_block": parts.experts_per_block,
        "rows": parts.expert_rows_per_block,
        "distributed_type": str(accelerator.distributed_type),
        "steps": steps,
        "tensors": len(optimizer.state),
    }


@pytest.fixture(scope="module")
def held() -> dict[str, Any]:
    (one,) = run_distributed(_held, 1, 1, timeout=300.0)
    ranks = run_distributed(_held_on_two, 2, timeout=300.0)
    return {"one": one, "ranks": [r["ddp"] for r in ranks], "fsdp": [r["fsdp"] for r in ranks]}


def _held_on_two() -> dict[str, Any]:
    """ep=2 under DDP, then ep=2 x dp_shard=2 under FSDP2, in the same 2 processes."""
    return {"ddp": _held(2), "fsdp": _held(2, dp_shard=2)}


def test_each_rank_holds_half_the_experts_and_the_whole_dense_part(held: dict[str, Any]) -> None:
    one = held["one"]
    assert one["per_block"] == {"model.layers.0.mlp": 8, "model.layers.1.mlp": 8}
    # 2 blocks x 8 experts x (32 x 32 + 32 x 16) fp32 elements; moments 2 x 4 bytes each, step counters apart
    expert_elements = 2 * 8 * (32 * 32 + 32 * 16)
    assert one["experts"]["parameter_bytes"] == one["experts"]["gradient_bytes"] == 4 * expert_elements
    assert one["experts"]["optimizer_state_bytes"] == 8 * expert_elements + 4 * 4  # 4 expert tensors' steps
    assert one["dense"]["parameter_bytes"] == 4 * (35_520 - expert_elements)  # of 35,520 parameters
    assert one["rows"] == one["per_block"]
    for rank in held["ranks"]:
        assert rank["distributed_type"] == "MULTI_CPU"
        assert rank["per_block"] == rank["rows"] == {"model.layers.0.mlp": 4, "model.layers.1.mlp": 4}
        for key in ("parameter_bytes", "gradient_bytes", "num_parameters"):
            assert rank["experts"][key] * 2 == one["experts"][key], key
            assert rank["dense"][key] == one["dense"][key], key  # DDP replicates the dense part
        # the moments halve; each rank keeps a step counter for each of its 4 expert tensors, as one process
        assert (
            rank["experts"]["optimizer_state_bytes"] - 16
            == (one["experts"]["optimizer_state_bytes"] - 16) // 2
        )
        assert rank["dense"]["optimizer_state_bytes"] == one["dense"]["optimizer_state_bytes"]
        expected = {k: rank["experts"][k] + rank["dense"][k] for k in ("parameter_bytes", "gradient_bytes")}
        assert {k: rank["all"][k] for k in expected} == expected  # nothing counted twice or left out


def test_under_fsdp2_each_rank_holds_half_the_experts_and_half_the_dense_part(held: dict[str, Any]) -> None:
    """ep=2 x dp_shard=2: the dense part FSDP2-sharded over both ranks; each rank's 4 experts over its replica
    group (itself alone): every part of one process's bytes halves, as the DTensors' local shards say."""
    one = held["one"]
    dense_steps = 4 * (one["tensors"] - 4)  # AdamW's step counter of each dense tensor, whole on every rank
    for rank in held["fsdp"]:
        assert rank["distributed_type"] == "FSDP" and rank["tensors"] == one["tensors"]
        assert rank["per_block"] == rank["rows"] == {"model.layers.0.mlp": 4, "model.layers.1.mlp": 4}
        for key in ("parameter_bytes", "gradient_bytes", "num_parameters"):
            assert rank["experts"][key] * 2 == one["experts"][key], key
            assert rank["dense"][key] * 2 == one["dense"][key], key  # DDP would hold it whole
        assert (
            rank["experts"]["optimizer_state_bytes"] - 16
            == (one["experts"]["optimizer_state_bytes"] - 16) // 2
        )
        assert (
            rank["dense"]["optimizer_state_bytes"] - dense_steps
            == (one["dense"]["optimizer_state_bytes"] - dense_steps) // 2
        )
        expected = {k: rank["experts"][k] + rank["dense"][k] for k in ("parameter_bytes", "gradient_bytes")}
        assert {k: rank["all"][k] for k in expected} == expected


def _estimate(folder: str, *flags: str) -> Any:
    return lockstep_in_process(
        "estimate-memory", folder, "--model-class", "Qwen3MoeForCausalLM", "--dtypes", "fp32",
        "--strategies", "ddp", "--num-processes", "1", *flags,
    )  # fmt: skip


def test_the_estimate_with_ep_size_equals_the_bytes_held(held: dict[str, Any], tmp_path: Any) -> None:
    folder = str(tmp_path / "qwen3_moe")
    _build("qwen3_moe").config.save_pretrained(folder)
    result = _estimate(folder, "--ep-size", "2", "--json")
    assert result.returncode == 0, result.stderr
    ddp, ep = json.loads(result.stdout)["estimates"]
    assert (ep["strategy"], ep["layout"], ep["num_processes"]) == ("ep", "ep=2", 2)
    one = held["one"]["all"]
    assert ddp["parameters"] == one["parameter_bytes"]  # the same model: the one-process bytes
    for rank in held["ranks"]:
        measured = rank["all"]
        assert ep["parameters"] == measured["parameter_bytes"]
        assert ep["gradients"] == measured["gradient_bytes"]
        assert ep["optimizer_state"] == measured["optimizer_state_bytes"] - rank["steps"]
        assert rank["steps"] == 4 * rank["tensors"]
    print(f"ep=2 per rank: estimated {ep['model_state']:,} B, one process {ddp['model_state']:,} B")
    assert ep["model_state"] < 0.7 * ddp["model_state"]  # the experts are most of this model


def test_the_estimate_with_ep_size_and_dp_shard_equals_the_bytes_held_under_fsdp2(
    held: dict[str, Any], tmp_path: Any
) -> None:
    folder = str(tmp_path / "qwen3_moe")
    _build("qwen3_moe").config.save_pretrained(folder)
    result = _estimate(folder, "--ep-size", "2", "--dp-shard", "2", "--json")
    assert result.returncode == 0, result.stderr
    ddp, ep, mesh = json.loads(result.stdout)["estimates"]
    assert (ep["strategy"], ep["layout"], ep["num_processes"]) == ("ep", "dp_shard=2 x ep=2", 2)
    for rank in held["fsdp"]:
        measured = rank["all"]
        assert ep["parameters"] == measured["parameter_bytes"]
        assert ep["gradients"] == measured["gradient_bytes"]
        assert ep["optimizer_state"] == measured["optimizer_state_bytes"] - rank["steps"]
    print(
        f"ep=2 x dp_shard=2 per rank: estimated {ep['model_state']:,} B, one process {ddp['model_state']:,} B"
    )
    # half of everything (the dense part and the experts), as FSDP2 alone holds (the mesh row: 1/N of all);
    # what ep changes under FSDP2 is which rank computes which expert, not the model state per rank
    assert ep["model_state"] * 2 == ddp["model_state"]
    assert (mesh["layout"], mesh["model_state"]) == ("dp_shard=2", ep["model_state"])


def test_the_estimate_refuses_an_ep_size_that_does_not_fit(tmp_path: Any) -> None:
    folder = str(tmp_path / "qwen3_moe")
    _build("qwen3_moe").config.save_pretrained(folder)
    result = _estimate(folder, "--ep-size", "3")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--ep-size 3 (ep_size=3) does not divide the 8 experts per block" in result.stderr
    assert "Pass an --ep-size that divides 8." in result.stderr
    result = _estimate(folder, "--ep-size", "2", "--dp-shard", "3")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--ep-size 2 with dp_shard=3 is invalid: ep_size must divide dp_shard" in result.stderr
    result = _estimate(folder, "--ep-size", "2", "--dp-shard", "2", "--tp", "2")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--ep-size 2 with dp_shard=2 x tp=2 is not built" in result.stderr
    dense = str(tmp_path / "llama")
    from transformers import LlamaConfig

    LlamaConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64
    ).save_pretrained(dense)
    result = lockstep_in_process("estimate-memory", dense, "--ep-size", "2", "--dtypes", "fp32")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--ep-size 2 (ep_size=2) asks for expert parallelism, but LlamaModel" in result.stderr
    assert "has no mixture-of-experts block" in result.stderr and "Drop --ep-size" in result.stderr
