"""Checkpoints under expert parallelism hold the layout one process has, and load on any ``ep``.

A user's loop (tiny Qwen3-MoE of :mod:`tests.expert_parallel.test_parity`, 8 experts per block, AdamW, one
global batch of 4 sequences per step) under ``Accelerator(parallelism_config=ParallelismConfig(ep_size=2))`` on
2 gloo processes, or ``Accelerator()`` on 1. Every comparison is bitwise (``torch.equal``) unless it crosses
layouts while training on. The expected full tensors of an ``ep=2`` run are assembled here from the ranks'
own shards (``named_parameters`` and ``optimizer.state``), not by the mechanism under test. A loading run
starts from other weights, so that a load that did nothing cannot pass.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from tests.expert_parallel.test_parity import ADAM_EPS, GLOBAL_BATCH, LR, _build, _micro_batch
from tests.helpers.multiprocess import run_distributed

pytestmark = pytest.mark.distributed

STEPS_BEFORE = 3
STEPS_AFTER = 3
ACROSS_LAYOUTS = 1e-6
"""Training on after a load on another number of processes: the same updates, summed in another order."""


def _accelerator(ep_size: int) -> Any:
    from lockstep import Accelerator, ParallelismConfig

    if ep_size == 1:
        return Accelerator()
    return Accelerator(parallelism_config=ParallelismConfig(ep_size=ep_size))


def _prepared(accelerator: Any, *, other_weights: bool) -> tuple[Any, Any, Any]:
    model = _build("qwen3_moe")
    if other_weights:  # a load that leaves the model as built cannot pass
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS)
    rows = torch.cat([_micro_batch(i) for i in range(STEPS_BEFORE + STEPS_AFTER)])
    loader = DataLoader(rows, batch_size=GLOBAL_BATCH // accelerator.num_processes)
    return accelerator.prepare(model, optimizer, loader)


def _train(accelerator: Any, model: Any, optimizer: Any, batches: Any, steps: int) -> list[torch.Tensor]:
    seen = []
    for _ in range(steps):
        ids = next(batches)
        seen.append(ids.clone())
        accelerator.backward(model(input_ids=ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()
    return seen


def _local(accelerator: Any, model: Any, optimizer: Any) -> dict[str, Any]:
    """This rank's parameters and AdamW moments by parameter name, and where its experts start."""
    unwrapped = accelerator.unwrap_model(model)
    params = {name: p.detach().clone() for name, p in unwrapped.named_parameters()}
    moments = {
        name: {key: value.clone() for key, value in optimizer.state[p].items()}
        for name, p in unwrapped.named_parameters()
        if p in optimizer.state
    }
    first = {name: m.first_expert for name, m in unwrapped.named_modules() if hasattr(m, "first_expert")}
    return {"rank": accelerator.process_index, "params": params, "moments": moments, "first": first}


def _save_and_train_on(folder: str, ep_size: int, async_save: bool = False) -> dict[str, Any]:
    """Train 3 steps, save, train 3 more: the state at the save, the batches after it and the final state.
    With ``async_save``, training goes on while the checkpoint is written."""
    accelerator = _accelerator(ep_size)
    model, optimizer, loader = _prepared(accelerator, other_weights=False)
    batches = iter(loader)
    _train(accelerator, model, optimizer, batches, STEPS_BEFORE)
    accelerator.save_state(folder, async_save=async_save)
    saved = _local(accelerator, model, optimizer)
    after = _train(accelerator, model, optimizer, batches, STEPS_AFTER)
    accelerator.wait_for_checkpoint()
    return {"saved": saved, "after": after, "final": _local(accelerator, model, optimizer)}


def _load_and_train_on(folder: str, ep_size: int) -> dict[str, Any]:
    """On a fresh Accelerator from other weights: load, then train what is left of the epoch."""
    accelerator = _accelerator(ep_size)
    model, optimizer, loader = _prepared(accelerator, other_weights=True)
    accelerator.load_state(folder)
    loaded = _local(accelerator, model, optimizer)
    batches = list(loader)  # the prepared loader resumes at the first batch not yet seen
    after = _train(accelerator, model, optimizer, iter(batches), len(batches))
    return {"loaded": loaded, "after": after, "final": _local(accelerator, model, optimizer)}


def _full(ranks: list[dict[str, Any]], name: str, pick: Any) -> torch.Tensor:
    """The one-process tensor of parameter ``name`` assembled from every rank's shard (``pick(rank)``)."""
    if ".experts." not in name:
        return pick(ranks[0])
    block = name.rsplit(".experts.", 1)[0] + ".experts"
    return torch.cat([pick(r) for r in sorted(ranks, key=lambda r: r["first"][block])])


def _assert_full_equals(ranks: list[dict[str, Any]], one: dict[str, Any]) -> None:
    """``one`` (a one-process state) equals the ranks' shards put together, bitwise, moments included."""
    assert one["params"].keys() == ranks[0]["params"].keys()
    assert one["moments"].keys() == ranks[0]["moments"].keys() == one["params"].keys()
    for name, tensor in one["params"].items():
        assert torch.equal(tensor, _full(ranks, name, lambda r, n=name: r["params"][n])), name
        assert one["moments"][name].keys() == {"exp_avg", "exp_avg_sq", "step"}
        assert torch.equal(one["moments"][name]["step"], ranks[0]["moments"][name]["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            expected = _full(ranks, name, lambda r, n=name, k=key: r["moments"][n][k])
            assert torch.equal(one["moments"][name][key], expected), (name, key)


def _assert_shards_equal(one: dict[str, Any], ranks: list[dict[str, Any]]) -> None:
    """Each rank holds its rows of the one-process state ``one``, bitwise, moments included."""
    for rank in ranks:
        assert rank["params"].keys() == one["params"].keys()
        for name, tensor in rank["params"].items():
            expected = one["params"][name]
            moments = one["moments"][name]
            if ".experts." in name:
                first = rank["first"][name.rsplit(".experts.", 1)[0] + ".experts"]
                rows = slice(first, first + tensor.shape[0])
                assert tensor.shape[0] < expected.shape[0]
                expected = expected[rows]
                moments = {k: v if v.dim() == 0 else v[rows] for k, v in moments.items()}
            assert torch.equal(tensor, expected), name
            for key, value in rank["moments"][name].items():
                assert torch.equal(value, moments[key]), (name, key)


def _assert_same(got: dict[str, Any], expected: dict[str, Any]) -> None:
    """Two states of one rank in the same layout: equal, bitwise, moments included."""
    assert got["first"] == expected["first"]
    assert got["params"].keys() == expected["params"].keys() == got["moments"].keys()
    for name, tensor in got["params"].items():
        assert torch.equal(tensor, expected["params"][name]), name
        assert got["moments"][name].keys() == expected["moments"][name].keys()
        for key, value in got["moments"][name].items():
            assert torch.equal(value, expected["moments"][name][key]), (name, key)


def test_saved_on_ep2_loads_on_one_process_bitwise(tmp_path: Any) -> None:
    folder = str(tmp_path / "ep2")
    ranks = run_distributed(_save_and_train_on, 2, folder, 2, timeout=300.0)
    (one,) = run_distributed(_load_and_train_on, 1, folder, 1, timeout=300.0)
    saved = [r["saved"] for r in ranks]
    _assert_full_equals(saved, one["loaded"])
    # the one process resumed at the step saved, on the same global batches, and ends where ep=2 ended
    assert len(one["after"]) == STEPS_AFTER
    for step, ids in enumerate(one["after"]):
        assert torch.equal(ids, torch.cat([r["after"][step] for r in ranks]))
    final = [r["final"] for r in ranks]
    worst = max(
        (tensor - _full(final, name, lambda r, n=name: r["params"][n])).abs().max().item()
        for name, tensor in one["final"]["params"].items()
    )
    print(f"ep=2 -> 1 process, {STEPS_AFTER} steps on: max parameter difference {worst:.3g}")
    assert worst < ACROSS_LAYOUTS


def test_saved_on_one_process_loads_on_ep2_bitwise(tmp_path: Any) -> None:
    folder = str(tmp_path / "one")
    (one,) = run_distributed(_save_and_train_on, 1, folder, 1, timeout=300.0)
    ranks = run_distributed(_load_and_train_on, 2, folder, 2, timeout=300.0)
    _assert_shards_equal(one["saved"], [r["loaded"] for r in ranks])
    worst = 0.0
    for rank in ranks:
        assert len(rank["after"]) == STEPS_AFTER
        for name, tensor in rank["final"]["params"].items():
            expected = one["final"]["params"][name]
            if ".experts." in name:
                first = rank["final"]["first"][name.rsplit(".experts.", 1)[0] + ".experts"]
                expected = expected[first : first + tensor.shape[0]]
            worst = max(worst, (tensor - expected).abs().max().item())
    print(f"1 process -> ep=2, {STEPS_AFTER} steps on: max parameter difference {worst:.3g}")
    assert worst < ACROSS_LAYOUTS


def test_saved_on_ep2_resumes_exactly_on_ep2(tmp_path: Any) -> None:
    folder = str(tmp_path / "ep2")
    # saved in the background: the gathered tensors are copied before the training goes on
    uninterrupted = run_distributed(_save_and_train_on, 2, folder, 2, True, timeout=300.0)
    resumed = run_distributed(_load_and_train_on, 2, folder, 2, timeout=300.0)
    for before, after in zip(uninterrupted, resumed, strict=True):
        assert after["loaded"]["rank"] == before["saved"]["rank"]
        _assert_same(after["loaded"], before["saved"])  # the same layout: each rank its own shard
        assert len(after["after"]) == STEPS_AFTER  # resumed at step 3, on the batches the first run saw next
        assert all(torch.equal(a, b) for a, b in zip(after["after"], before["after"], strict=True))
        _assert_same(after["final"], before["final"])


def test_saved_on_ep2_loads_on_ep4(tmp_path: Any) -> None:
    folder = str(tmp_path / "ep2")
    ranks = run_distributed(_save_and_train_on, 2, folder, 2, timeout=300.0)
    four = run_distributed(_load_and_train_on, 4, folder, 4, timeout=300.0)
    saved = [r["saved"] for r in ranks]
    one = {
        "params": {n: _full(saved, n, lambda r, n=n: r["params"][n]) for n in saved[0]["params"]},
        "moments": {
            n: {
                k: _full(saved, n, lambda r, n=n, k=k: r["moments"][n][k]) if k != "step" else v
                for k, v in saved[0]["moments"][n].items()
            }
            for n in saved[0]["moments"]
        },
    }
    loaded = [r["loaded"] for r in four]
    assert sorted(r["first"]["model.layers.0.mlp.experts"] for r in loaded) == [0, 2, 4, 6]
    _assert_shards_equal(one, loaded)


def _exported(folder: str) -> dict[str, Any]:
    accelerator = _accelerator(2)
    model, optimizer, loader = _prepared(accelerator, other_weights=False)
    _train(accelerator, model, optimizer, iter(loader), STEPS_BEFORE)
    state_dict = accelerator.get_state_dict(model)
    accelerator.save_model(model, folder)
    after = accelerator.unwrap_model(model).state_dict()  # a plain state_dict: this rank's shard again
    return {
        "local": _local(accelerator, model, optimizer),
        "state_dict": {name: tensor.clone() for name, tensor in state_dict.items()},
        "plain_shapes": {name: tuple(tensor.shape) for name, tensor in after.items()},
        "files": sorted(os.listdir(folder)),
    }


def test_save_model_and_get_state_dict_write_the_one_process_layout(tmp_path: Any) -> None:
    from safetensors.torch import load_file
    from transformers import Qwen3MoeForCausalLM

    folder = str(tmp_path / "model")
    ranks = run_distributed(_exported, 2, folder, timeout=300.0)
    unswapped = _build("qwen3_moe").state_dict()
    expected = {
        name: _full([r["local"] for r in ranks], name, lambda r, n=name: r["params"][n]) for name in unswapped
    }
    assert ranks[0]["files"] == ["model.safetensors"]
    written = load_file(os.path.join(folder, "model.safetensors"))
    for rank in ranks:
        assert {n: t.shape for n, t in rank["state_dict"].items()} == {
            n: t.shape for n, t in unswapped.items()
        }
        assert rank["plain_shapes"]["model.layers.0.mlp.experts.gate_up_proj"] == (4, 32, 32)
        assert all(torch.equal(rank["state_dict"][n], expected[n]) for n in expected)
    assert {n: t.shape for n, t in written.items()} == {n: t.shape for n, t in unswapped.items()}
    assert all(torch.equal(written[n], expected[n]) for n in expected)
    # into a fresh one-process model: load_state_dict(strict=True), and from_pretrained with its config
    fresh = _build("qwen3_moe")
    fresh.load_state_dict(ranks[0]["state_dict"], strict=True)
    assert all(torch.equal(fresh.state_dict()[n], expected[n]) for n in expected)
    fresh.config.save_pretrained(folder)
    loaded = Qwen3MoeForCausalLM.from_pretrained(folder)
    assert all(torch.equal(loaded.state_dict()[n], expected[n]) for n in expected)
    # the experts trained: the layout check is not one of untouched initial weights
    moved = (
        expected["model.layers.0.mlp.experts.down_proj"] - unswapped["model.layers.0.mlp.experts.down_proj"]
    )
    assert moved.abs().max().item() > 1e-4


def _factored_optimizer(folder: str) -> dict[str, Any]:
    from lockstep.layers.expert_parallel import ExpertParallelNotBuiltError

    accelerator = _accelerator(2)
    model = _build("qwen3_moe")
    optimizer = torch.optim.Adafactor(model.parameters(), lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = _micro_batch(0)[2 * accelerator.process_index : 2 * accelerator.process_index + 2]
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    optimizer.step()
    with pytest.raises(ExpertParallelNotBuiltError) as refused:
        accelerator.save_state(os.path.join(folder, "state"))
    accelerator.save_model(model, os.path.join(folder, "model"))  # the weights alone still export
    return {"message": str(refused.value), "files": sorted(os.listdir(folder))}


def test_an_optimizer_state_not_shaped_like_its_parameter_is_refused_before_writing(tmp_path: Any) -> None:
    for rank in run_distributed(_factored_optimizer, 2, str(tmp_path), timeout=300.0):
        assert rank["message"].startswith("Adafactor's state 'col_var' of an expert parameter has shape")
        assert "Use such an optimizer, or train without ParallelismConfig(ep_size=...)" in rank["message"]
        assert rank["files"] == ["model"]  # no checkpoint folder: the refusal came before the first file


def _assembled(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The one-process state (parameters and moments) put together from one ep group's shards."""
    return {
        "params": {n: _full(ranks, n, lambda r, n=n: r["params"][n]) for n in ranks[0]["params"]},
        "moments": {
            n: {
                k: _full(ranks, n, lambda r, n=n, k=k: r["moments"][n][k]) if k != "step" else v
                for k, v in ranks[0]["moments"][n].items()
            }
            for n in ranks[0]["moments"]
        },
    }


def _replicated_load_train_save(from_ep2: str, from_one: str, folder: str) -> dict[str, Any]:
    """ep=2 on 4 processes (2 replicas of each expert shard): load an ep=2 checkpoint, then a one-process one
    (both saved at step 3), train the 3 steps left on the latter, and save."""
    accelerator = _accelerator(2)
    model, optimizer, loader = _prepared(accelerator, other_weights=True)
    accelerator.load_state(from_ep2)
    from_ep2_loaded = _local(accelerator, model, optimizer)
    accelerator.load_state(from_one)
    from_one_loaded = _local(accelerator, model, optimizer)
    batches = list(loader)  # resumed at step 3
    after = _train(accelerator, model, optimizer, iter(batches), len(batches))
    accelerator.save_state(folder)
    return {
        "from_ep2": from_ep2_loaded,
        "from_one": from_one_loaded,
        "after": after,
        "final": _local(accelerator, model, optimizer),
    }


def test_replicated_experts_load_any_layout_and_save_the_one_process_layout(tmp_path: Any) -> None:
    """ep=2 on 4 processes loads checkpoints of 1 process and of ep=2 on 2 (each rank its rows, bitwise),
    trains on as the one process did, and saves what 1 process loads bitwise (one ep group's experts)."""
    one_folder, ep2_folder, four_folder = (str(tmp_path / name) for name in ("one", "ep2", "four"))
    (one,) = run_distributed(_save_and_train_on, 1, one_folder, 1, timeout=300.0)
    ep2 = run_distributed(_save_and_train_on, 2, ep2_folder, 2, timeout=300.0)
    four = run_distributed(_replicated_load_train_save, 4, ep2_folder, one_folder, four_folder, timeout=300.0)
    assert [r["final"]["first"]["model.layers.0.mlp.experts"] for r in four] == [0, 4, 0, 4]
    _assert_shards_equal(_assembled([r["saved"] for r in ep2]), [r["from_ep2"] for r in four])
    _assert_shards_equal(one["saved"], [r["from_one"] for r in four])
    # trained on from the one-process checkpoint: its batches, split over the 4 ranks, and its weights
    for step, ids in enumerate(one["after"]):
        assert torch.equal(ids, torch.cat([r["after"][step] for r in four]))
    worst = 0.0
    for rank in four:
        for name, tensor in rank["final"]["params"].items():
            expected = one["final"]["params"][name]
            if ".experts." in name:
                first = rank["final"]["first"][name.rsplit(".experts.", 1)[0] + ".experts"]
                expected = expected[first : first + tensor.shape[0]]
            worst = max(worst, (tensor - expected).abs().max().item())
    print(f"1 process -> ep=2 x 2 replicas, {STEPS_AFTER} steps on: max parameter difference {worst:.3g}")
    assert worst < ACROSS_LAYOUTS
    # the replicas of a shard are the same, bitwise; ep group {0, 1} holds the one-process model
    for first, replica in ((four[0], four[2]), (four[1], four[3])):
        _assert_same(replica["final"], first["final"])
    (back,) = run_distributed(_load_and_train_on, 1, four_folder, 1, timeout=300.0)
    _assert_full_equals([four[0]["final"], four[1]["final"]], back["loaded"])
