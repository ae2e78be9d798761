"""FSDP checkpoints: sharded DCP saves reload exactly on another number of processes (2->1, 1->2, 2->3),
full state dicts round-trip, async saves commit, and merge-weights rebuilds the whole model offline."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lockstep import Accelerator, FullyShardedDataParallelPlugin
from lockstep.checkpoint import layout
from tests.helpers.cli import lockstep, lockstep_in_process
from tests.helpers.fsdp_models import data_loader, full_params, loss_of, make_transformer
from tests.helpers.multiprocess import run_distributed


def _full_optimizer_state(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    state = get_optimizer_state_dict(
        model, optimizer.optimizer, options=StateDictOptions(full_state_dict=True)
    )
    return {
        f"{name}.{key}": value.clone()
        for name, entry in state["state"].items()
        for key, value in entry.items()
    }


def _setup(state_dict_type: str, seed: int = 0):
    accelerator = Accelerator(
        fsdp_plugin=FullyShardedDataParallelPlugin(
            transformer_cls_names_to_wrap=["TinyDecoderLayer"], state_dict_type=state_dict_type
        )
    )
    model = make_transformer(seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def _save(world: int, folder: str, state_dict_type: str, async_save: bool = False) -> dict:
    accelerator, model, optimizer = _setup(state_dict_type)
    for batch in data_loader(24, 4):
        accelerator.backward(loss_of(model, batch))
        optimizer.step()
        optimizer.zero_grad()
    accelerator.save_state(folder, async_save=async_save)
    accelerator.wait_for_checkpoint()
    full = accelerator.get_state_dict(model)
    return {"params": full_params(model), "optimizer": _full_optimizer_state(model, optimizer), "full": full}


def _load(world: int, folder: str, state_dict_type: str) -> dict:
    accelerator, model, optimizer = _setup(state_dict_type, seed=7)  # different weights before loading
    accelerator.load_state(folder)
    loaded = {"params": full_params(model), "optimizer": _full_optimizer_state(model, optimizer)}
    batch = next(iter(data_loader(8, 4)))
    accelerator.backward(loss_of(model, batch))
    optimizer.step()  # the loaded optimizer state is usable
    return loaded


def _assert_same(saved: dict, loaded: dict) -> None:
    assert torch.equal(saved["params"], loaded["params"])
    assert saved["optimizer"].keys() == loaded["optimizer"].keys()
    for key, value in saved["optimizer"].items():
        assert torch.equal(value, loaded["optimizer"][key]), key


@pytest.fixture(scope="module")
def sharded_on_two(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """A sharded checkpoint saved on 2 processes, and what they saved; the tests using it only read it."""
    folder = str(tmp_path_factory.mktemp("sharded_on_two") / "ckpt")
    return folder, run_distributed(_save, 2, 2, folder, "SHARDED_STATE_DICT")[0]


@pytest.mark.distributed
@pytest.mark.parametrize(("save_world", "load_world"), [(2, 1), (1, 2), (2, 3)])
def test_sharded_checkpoint_reloads_exactly_on_another_world_size(tmp_path, request, save_world, load_world):
    if save_world == 2:
        folder, saved = request.getfixturevalue("sharded_on_two")
    else:
        folder = str(tmp_path / "ckpt")
        saved = run_distributed(_save, save_world, save_world, folder, "SHARDED_STATE_DICT")[0]
    names = {p.name for p in Path(folder).iterdir()}
    assert {"pytorch_model_fsdp_0", "optimizer_0", "manifest.json"} <= names
    assert "model.safetensors" not in names and "optimizer.bin" not in names
    assert len(list((Path(folder) / "pytorch_model_fsdp_0").glob("*.distcp"))) == save_world
    layout.verify(Path(folder))  # every shard is listed in the manifest with its checksum
    for loaded in run_distributed(_load, load_world, load_world, folder, "SHARDED_STATE_DICT"):
        _assert_same(saved, loaded)


@pytest.mark.distributed
def test_full_state_dict_checkpoint_round_trip(tmp_path):
    folder = str(tmp_path / "ckpt")
    saved = run_distributed(_save, 2, 2, folder, "FULL_STATE_DICT")[0]
    assert {"model.safetensors", "optimizer.bin"} <= {p.name for p in Path(folder).iterdir()}
    on_disk = load_file(str(Path(folder) / "model.safetensors"))
    assert on_disk.keys() == saved["full"].keys()
    for loaded in run_distributed(_load, 3, 3, folder, "FULL_STATE_DICT"):
        _assert_same(saved, loaded)


@pytest.mark.distributed
def test_async_sharded_save_commits_and_reloads(tmp_path):
    folder = str(tmp_path / "ckpt")
    saved = run_distributed(_save, 2, 2, folder, "SHARDED_STATE_DICT", True)[0]
    layout.verify(Path(folder))
    _assert_same(saved, run_distributed(_load, 2, 2, folder, "SHARDED_STATE_DICT")[0])


@pytest.mark.distributed
def test_merge_weights_equals_the_gathered_state_dict(tmp_path, sharded_on_two):
    folder, saved = sharded_on_two
    result = lockstep("merge-weights", folder, str(tmp_path / "merged"))
    assert result.returncode == 0, result.stderr
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert merged.keys() == saved["full"].keys()
    for key, value in saved["full"].items():
        assert torch.equal(merged[key], value), key
    model = make_transformer(seed=3)
    model.load_state_dict(merged)  # loads into the plain architecture
    assert torch.equal(full_params(model), saved["params"])


def test_merge_weights_bad_input_exits_2(tmp_path):
    result = lockstep_in_process("merge-weights", str(tmp_path), str(tmp_path / "out"))
    assert result.returncode == 2
    assert "is not a sharded checkpoint" in result.stderr
    result = lockstep_in_process("merge-weights", str(tmp_path / "missing"), str(tmp_path / "out"))
    assert result.returncode == 2 and "is not a folder" in result.stderr


def _save_mid_cycle(world: int, folder: str) -> list[str]:
    import logging

    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)  # a test before may have lowered the root logger's level
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lockstep.checkpoint").addHandler(handler)
    accelerator = Accelerator(
        gradient_accumulation_steps=2,
        fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["TinyDecoderLayer"]),
    )
    model = accelerator.prepare(make_transformer())
    batch = next(iter(data_loader(8, 4)))
    with accelerator.accumulate(model):  # the first micro-batch: gradients pending inside FSDP
        accelerator.backward(loss_of(model, batch))
    accelerator.save_state(folder)
    mid_cycle = list(messages)
    messages.clear()
    with accelerator.accumulate(model):  # the cycle ends: nothing is pending
        accelerator.backward(loss_of(model, batch))
    accelerator.save_state(folder + "_synced")
    return [*mid_cycle, "--", *messages]


@pytest.mark.distributed
def test_saving_in_the_middle_of_an_accumulation_cycle_with_fsdp_warns_that_gradients_are_not_saved(tmp_path):
    messages = run_distributed(_save_mid_cycle, 1, 1, str(tmp_path / "ckpt"))[0]
    assert messages == [
        "save_state in the middle of a gradient accumulation cycle with FSDP: the gradients of the "
        "micro-batches so far live inside FSDP and are not saved; save after an optimizer step.",
        "--",
    ]
    assert not list((tmp_path / "ckpt").glob("grads_*"))  # no file pretends to hold them


def _load_plain(folder: str) -> dict:
    accelerator = Accelerator()  # no FSDP: the shards are read whole (lockstep.backends.from_shards)
    model = make_transformer(seed=7)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.load_state(folder)
    return {"params": full_params(model), "optimizer": _full_optimizer_state(model, optimizer)}


@pytest.mark.distributed
def test_sharded_checkpoint_loads_without_fsdp_in_one_process(sharded_on_two):
    folder, saved = sharded_on_two
    _assert_same(saved, _load_plain(folder))


def test_torch_numbered_optimizer_state_is_renamed_after_the_parameters_for_fsdp():
    """One process and DDP write torch's own optimizer state (parameters numbered in the optimizer's order);
    FSDP's full optimizer state is keyed by name: the numbers are renamed group by group, a mismatch refused."""
    from lockstep.backends.fsdp.checkpoint import by_name

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    optimizer = torch.optim.AdamW([{"params": [model[1].weight]}, {"params": [model[0].bias]}], lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    renamed = by_name(model, optimizer, optimizer.state_dict())
    assert sorted(renamed["state"]) == ["0.bias", "1.weight"]
    assert [g["params"] for g in renamed["param_groups"]] == [["1.weight"], ["0.bias"]]
    assert torch.equal(renamed["state"]["0.bias"]["exp_avg"], optimizer.state[model[0].bias]["exp_avg"])
    assert by_name(model, optimizer, renamed) is renamed  # already by name: unchanged
    other = torch.optim.AdamW(model.parameters())
    with pytest.raises(
        ValueError, match=r"parameter groups of \[1, 1\] parameters; the optimizer prepared now has \[4\]"
    ):
        by_name(model, other, optimizer.state_dict())
