"""Checkpoints under expert parallelism with FSDP2 (``ParallelismConfig(dp_shard_size=N, ep_size=2)``) hold the
layout one process has.

The loop of :mod:`tests.expert_parallel.test_checkpoint` (tiny Qwen3-MoE, AdamW, one global batch of 4 sequences
per step, 3 steps, save, 3 more). One 2-process spawn does every ep=2 x dp_shard=2 part: train and save, go on
training (the uninterrupted run); a fresh Accelerator from other weights loads that checkpoint and trains the same
3 steps (the resumed run); another loads the one-process checkpoint; ``get_state_dict`` and ``save_model``. One
4-process spawn does the same on ep=2 x dp_shard=4 (each half of the experts FSDP2-sharded over 2 replicas) and
also loads the 2-process checkpoint. A one-process spawn before writes the one-process checkpoint, one after
loads both distributed checkpoints and ``save_model`` folders. Every comparison is bitwise (``torch.equal``);
the expected tensors of a distributed run are each rank's own (DTensors gathered with ``full_tensor`` over their
mesh here, not by the mechanism under test).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tests.expert_parallel.test_checkpoint import (
    STEPS_AFTER,
    STEPS_BEFORE,
    _assert_full_equals,
    _assert_same,
    _assert_shards_equal,
    _full,
    _prepared,
    _train,
)
from tests.expert_parallel.test_parity import _build
from tests.helpers.multiprocess import run_distributed

pytestmark = pytest.mark.distributed

BLOCK = "model.layers.0.mlp.experts"
PROCESSES = (2, 4)
"""ep=2 x dp_shard=2 (each rank's experts on a replica group of one) and ep=2 x dp_shard=4 (each half of the
experts FSDP2-sharded over 2 replicas)."""


def _accelerator(processes: int) -> Any:
    from lockstep import Accelerator, ParallelismConfig

    if processes == 1:
        return Accelerator()
    return Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=processes, ep_size=2))


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def _local(accelerator: Any, model: Any, optimizer: Any) -> dict[str, Any]:
    """This rank's parameters and AdamW moments by name (experts: this rank's ep shard, gathered over its replica
    group; dense ones whole), and where its experts start."""
    unwrapped = accelerator.unwrap_model(model)
    params = {name: _whole(p) for name, p in unwrapped.named_parameters()}
    moments = {
        name: {key: _whole(value) for key, value in sorted(optimizer.state[p].items())}
        for name, p in unwrapped.named_parameters()
        if p in optimizer.state
    }
    first = {name: m.first_expert for name, m in unwrapped.named_modules() if hasattr(m, "first_expert")}
    return {"rank": accelerator.process_index, "params": params, "moments": moments, "first": first}


def _load_and_train(folder: str, processes: int) -> dict[str, Any]:
    accelerator = _accelerator(processes)
    model, optimizer, loader = _prepared(accelerator, other_weights=True)
    accelerator.load_state(folder)
    loaded = _local(accelerator, model, optimizer)
    batches = list(loader)  # the prepared loader resumes at the first batch not yet seen
    after = _train(accelerator, model, optimizer, iter(batches), len(batches))
    return {"loaded": loaded, "after": after, "final": _local(accelerator, model, optimizer)}


def _save_one_process(folder: str) -> dict[str, Any]:
    accelerator = _accelerator(1)
    model, optimizer, loader = _prepared(accelerator, other_weights=False)
    _train(accelerator, model, optimizer, iter(loader), STEPS_BEFORE)
    accelerator.save_state(folder)
    return {"saved": _local(accelerator, model, optimizer)}


def _on_many(folder: str, from_one: str, model_folder: str, other: str | None = None) -> dict[str, Any]:
    """ep=2 x dp_shard=N on N processes (the world): save, export, train on; resume; load the one-process
    checkpoint and, with ``other``, that checkpoint of another layout."""
    processes = int(os.environ["WORLD_SIZE"])
    accelerator = _accelerator(processes)
    model, optimizer, loader = _prepared(accelerator, other_weights=False)
    batches = iter(loader)
    _train(accelerator, model, optimizer, batches, STEPS_BEFORE)
    accelerator.save_state(folder)
    saved = _local(accelerator, model, optimizer)
    gate_up = accelerator.unwrap_model(model).get_parameter(f"{BLOCK}.gate_up_proj")
    state_dict = accelerator.get_state_dict(model)
    accelerator.save_model(model, model_folder)
    after = _train(accelerator, model, optimizer, batches, STEPS_AFTER)
    return {
        "saved": saved,
        "local_rows": gate_up.to_local().shape[0],
        "state_dict": {name: tensor.clone() for name, tensor in state_dict.items()},
        "after": after,
        "final": _local(accelerator, model, optimizer),
        "resumed": _load_and_train(folder, processes),
        "from_one": _load_and_train(from_one, processes)["loaded"],
        "from_other": None if other is None else _load_and_train(other, processes)["loaded"],
    }


def _on_one(folders: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Each (checkpoint, save_model folder) loaded on one process."""
    from safetensors.torch import load_file

    results = []
    for folder, model_folder in folders:
        result = _load_and_train(folder, 1)
        fresh = _build("qwen3_moe")
        fresh.load_state_dict(load_file(os.path.join(model_folder, "model.safetensors")), strict=True)
        result["exported"] = {name: tensor.detach().clone() for name, tensor in fresh.state_dict().items()}
        results.append(result)
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("fsdp_ep_checkpoint")
    from_one = str(root / "one")
    (one,) = run_distributed(_save_one_process, 1, from_one, timeout=300.0)
    runs: dict[str, Any] = {"one": one}
    for processes in PROCESSES:
        folders = (str(root / f"dp_shard{processes}"), str(root / f"model{processes}"))
        other = runs["folders2"][0] if processes == 4 else None  # dp_shard=2's checkpoint loads on dp_shard=4
        runs[processes] = run_distributed(
            _on_many, processes, folders[0], from_one, folders[1], other, timeout=300.0
        )
        runs[f"folders{processes}"] = folders
    (loaded,) = run_distributed(_on_one, 1, [runs[f"folders{p}"] for p in PROCESSES], timeout=300.0)
    for processes, result in zip(PROCESSES, loaded, strict=True):
        runs[f"loaded_on_one{processes}"] = result
    return runs


@pytest.mark.parametrize("processes", PROCESSES)
def test_the_ranks_hold_half_the_experts(runs: dict[str, Any], processes: int) -> None:
    assert sorted(r["saved"]["first"][BLOCK] for r in runs[processes]) == sorted([0, 4] * (processes // 2))
    assert runs[processes][0]["saved"]["params"][f"{BLOCK}.gate_up_proj"].shape[0] == 4
    assert runs[processes][0]["local_rows"] == 4 // (processes // 2)  # FSDP2 over the replicas


@pytest.mark.parametrize("processes", PROCESSES)
def test_saved_on_ep2_x_dp_shard_n_loads_on_one_process_bitwise(runs: dict[str, Any], processes: int) -> None:
    saved = [r["saved"] for r in runs[processes][:2]]  # ep group {0, 1}; the others hold the same
    one = runs[f"loaded_on_one{processes}"]
    _assert_full_equals(saved, one["loaded"])
    assert len(one["after"]) == STEPS_AFTER
    for step, ids in enumerate(one["after"]):
        assert torch.equal(ids, torch.cat([r["after"][step] for r in runs[processes]]))
    final = [r["final"] for r in runs[processes][:2]]
    worst = max(
        (tensor - _full(final, name, lambda r, n=name: r["params"][n])).abs().max().item()
        for name, tensor in one["final"]["params"].items()
    )
    print(
        f"ep=2 x dp_shard={processes} -> 1 process, {STEPS_AFTER} steps on: max parameter difference {worst:.3g}"
    )
    assert worst < 1e-6


@pytest.mark.parametrize("processes", PROCESSES)
def test_saved_on_one_process_loads_on_ep2_x_dp_shard_n_bitwise(runs: dict[str, Any], processes: int) -> None:
    _assert_shards_equal(runs["one"]["saved"], [r["from_one"] for r in runs[processes]])


@pytest.mark.parametrize("processes", PROCESSES)
def test_saved_on_ep2_x_dp_shard_n_resumes_exactly(runs: dict[str, Any], processes: int) -> None:
    for rank in runs[processes]:
        resumed = rank["resumed"]
        _assert_same(resumed["loaded"], rank["saved"])
        assert len(resumed["after"]) == STEPS_AFTER
        assert all(torch.equal(a, b) for a, b in zip(resumed["after"], rank["after"], strict=True))
        _assert_same(resumed["final"], rank["final"])


@pytest.mark.parametrize("processes", PROCESSES)
def test_save_model_and_get_state_dict_write_the_one_process_layout(
    runs: dict[str, Any], processes: int
) -> None:
    saved = [r["saved"] for r in runs[processes][:2]]
    expected = {name: _full(saved, name, lambda r, n=name: r["params"][n]) for name in saved[0]["params"]}
    exported = runs[f"loaded_on_one{processes}"]["exported"]
    assert exported.keys() == expected.keys()
    assert all(torch.equal(exported[n], expected[n]) for n in expected)
    main, *others = runs[processes]
    assert main["state_dict"].keys() == expected.keys()  # as FSDP2's: the whole state on the main process
    assert all(torch.equal(main["state_dict"][n], expected[n]) for n in expected)
    assert all(other["state_dict"] == {} for other in others)


def test_saved_on_ep2_x_dp_shard2_loads_on_ep2_x_dp_shard4_bitwise(runs: dict[str, Any]) -> None:
    saved = [r["saved"] for r in runs[2]]
    one = {
        "params": {n: _full(saved, n, lambda r, n=n: r["params"][n]) for n in saved[0]["params"]},
        "moments": {
            n: {
                k: v if k == "step" else _full(saved, n, lambda r, n=n, k=k: r["moments"][n][k])
                for k, v in saved[0]["moments"][n].items()
            }
            for n in saved[0]["moments"]
        },
    }
    _assert_shards_equal(one, [r["from_other"] for r in runs[4]])
