"""FSDP checkpoints both ways with Hugging Face Accelerate (never imported here).

Accelerate's FSDP2 checkpoints are written by real FSDP2 processes with torch alone, in the layout Accelerate
1.15's ``save_state`` writes (``save_fsdp_model``/``save_fsdp_optimizer``): ``SHARDED_STATE_DICT`` as DCP
folders ``pytorch_model_fsdp_0/`` holding ``{"model": ...}`` and ``optimizer_0/`` holding
``{"optimizer": ...}``; ``FULL_STATE_DICT`` as ``pytorch_model_fsdp.bin`` and ``optimizer.bin``; plus
``scheduler.bin`` and ``random_states_N.pkl``. lockstep loads them on 1 and 2 processes and training
continues; lockstep's own FSDP checkpoint has the same DCP keys and is read the way Accelerate reads one.
"""

from __future__ import annotations

import logging
import os
import pickle
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lockstep import Accelerator, FullyShardedDataParallelPlugin
from lockstep.checkpoint import layout, safe_dcp
from lockstep.errors import UnsafeCheckpointError
from lockstep.utils import load_fsdp_model, load_fsdp_optimizer, save_fsdp_model, save_fsdp_optimizer
from tests.helpers.fsdp_models import data_loader, full_params, loss_of, make_transformer
from tests.helpers.multiprocess import run_distributed

WARNING_PREFIX = "was written by Hugging Face Accelerate: it is loaded without lockstep's guarantees"


def _optimizer_state(model, optimizer) -> dict[str, torch.Tensor]:
    """Every optimizer tensor, gathered whole, keyed "<parameter>.<name>" (call on every rank)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    inner = getattr(optimizer, "optimizer", optimizer)
    state = get_optimizer_state_dict(model, inner, options=StateDictOptions(full_state_dict=True))
    return {f"{n}.{k}": v.clone() for n, entry in state["state"].items() for k, v in entry.items()}


def _plain_fsdp_model(seed: int):
    """A model sharded with torch's fully_shard directly (per decoder layer, then the root), as Accelerate does."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = make_transformer(seed=seed)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _write_accelerate_checkpoints(world: int, root: str) -> dict:
    """What Accelerate 1.15's save_state writes for an FSDP2 model, an AdamW and a scheduler, both ways."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = _plain_fsdp_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for index, batch in enumerate(data_loader(16, 4)):
        if index % world == rank:
            loss_of(model, batch).backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    sharded, full = Path(root) / "sharded", Path(root) / "full"
    # SHARDED_STATE_DICT: save_fsdp_model / save_fsdp_optimizer (FSDP2 branch)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=sharded / "pytorch_model_fsdp_0")
    optimizer_state = get_optimizer_state_dict(model, optimizer)
    dcp.save({"optimizer": optimizer_state}, checkpoint_id=sharded / "optimizer_0")
    # FULL_STATE_DICT: gathered with offload_to_cpu and rank0_only on more than one process
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, broadcast_from_rank0=True)
    whole_model = get_model_state_dict(model, options=options)
    whole_optimizer = get_optimizer_state_dict(model, optimizer, options=options)
    torch.manual_seed(100 + rank)
    rng = {"step": 3, "random_state": random.getstate(), "numpy_random_seed": np.random.get_state()}
    rng["torch_manual_seed"] = torch.get_rng_state()
    for folder in (sharded, full):
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(rng, folder / f"random_states_{rank}.pkl")
        if rank == 0:
            torch.save(scheduler.state_dict(), folder / "scheduler.bin")
    if rank == 0:
        torch.save(whole_model, full / "pytorch_model_fsdp.bin")
        torch.save(whole_optimizer, full / "optimizer.bin")
    dist.barrier()
    return {
        "params": full_params(model),
        "optimizer": _optimizer_state(model, optimizer),
        "lr": scheduler.get_last_lr(),
        "next_random": torch.rand(1).item(),
        "full": {k: v.clone() for k, v in whole_model.items()},
    }


@pytest.fixture(scope="module")
def accelerate_checkpoints(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("accelerate_fsdp")
    return root, run_distributed(_write_accelerate_checkpoints, 2, 2, str(root))


def _fsdp_accelerator(state_dict_type: str) -> Accelerator:
    plugin = FullyShardedDataParallelPlugin(
        transformer_cls_names_to_wrap=["TinyDecoderLayer"], state_dict_type=state_dict_type
    )
    return Accelerator(fsdp_plugin=plugin)


def _capture_warnings() -> list[str]:
    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)  # a test before may have lowered the root logger's level
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lockstep.checkpoint").addHandler(handler)
    return messages


def _load_with_lockstep(world: int, folder: str, state_dict_type: str) -> dict:
    messages = _capture_warnings()
    accelerator = _fsdp_accelerator(state_dict_type)
    model = make_transformer(seed=7)  # other weights before loading
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    accelerator.load_state(folder)
    loaded = {
        "params": full_params(model),
        "optimizer": _optimizer_state(model, optimizer),
        "lr": scheduler.get_last_lr(),
        "step": accelerator.step,
        "next_random": torch.rand(1).item(),
        "warnings": [m for m in messages if WARNING_PREFIX in m],
    }
    for batch in data_loader(8, 4):  # training continues from the loaded state
        accelerator.backward(loss_of(model, batch))
        optimizer.step()
        optimizer.zero_grad()
    loaded["trained"] = full_params(model)
    return loaded


def _assert_loaded(saved: dict, loaded: dict, rank: int) -> None:
    assert torch.equal(loaded["params"], saved["params"])
    assert loaded["optimizer"].keys() == saved["optimizer"].keys()
    for key, value in saved["optimizer"].items():
        assert torch.equal(loaded["optimizer"][key], value), key
    assert loaded["lr"] == saved["lr"] and loaded["step"] == 3
    assert loaded["next_random"] == saved["next_random"]  # this rank's RNG state came back
    assert len(loaded["warnings"]) == (1 if rank == 0 else 0)  # one line, from the main process
    assert (
        rank > 0
        or "no manifest (files are not checksummed), and no dataloader positions" in loaded["warnings"][0]
    )
    assert not torch.equal(loaded["trained"], loaded["params"])


@pytest.mark.distributed
@pytest.mark.parametrize("load_world", [2, 1])
def test_lockstep_loads_accelerates_sharded_fsdp_checkpoint_on_any_world_size(
    accelerate_checkpoints, load_world
):
    root, saved = accelerate_checkpoints
    folder = root / "sharded"
    assert layout.written_by_accelerate(folder)
    results = run_distributed(_load_with_lockstep, load_world, load_world, str(folder), "SHARDED_STATE_DICT")
    for rank, loaded in enumerate(results):
        _assert_loaded(saved[rank], loaded, rank)


@pytest.mark.distributed
def test_lockstep_loads_accelerates_full_fsdp_checkpoint_whatever_its_plugin_says(accelerate_checkpoints):
    root, saved = accelerate_checkpoints
    # The plugin says SHARDED_STATE_DICT; the folder holds full state dicts: loading follows the folder.
    results = run_distributed(_load_with_lockstep, 2, 2, str(root / "full"), "SHARDED_STATE_DICT")
    for rank, loaded in enumerate(results):
        _assert_loaded(saved[rank], loaded, rank)


def test_a_one_process_run_without_fsdp_loads_accelerates_full_fsdp_checkpoint(
    accelerate_checkpoints, caplog
):
    root, saved = accelerate_checkpoints
    accelerator = Accelerator()
    model = make_transformer(seed=7)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    with caplog.at_level(logging.WARNING, logger="lockstep.checkpoint"):
        accelerator.load_state(str(root / "full"))
    assert [r.getMessage().count(WARNING_PREFIX) for r in caplog.records] == [1]
    for key, value in saved[0]["full"].items():
        assert torch.equal(model.state_dict()[key], value), key
    assert _optimizer_state(model, optimizer.optimizer).keys() == saved[0]["optimizer"].keys()
    for key, value in _optimizer_state(model, optimizer.optimizer).items():
        assert torch.equal(value, saved[0]["optimizer"][key]), key
    assert scheduler.get_last_lr() == saved[0]["lr"] and accelerator.step == 3


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def _refused_messages(world: int, folders: list[str]) -> list[str]:
    accelerator = _fsdp_accelerator("FULL_STATE_DICT")
    model = make_transformer(seed=7)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    accelerator.prepare(model, optimizer, scheduler)
    messages = []
    for folder in folders:
        with pytest.raises(UnsafeCheckpointError) as caught:
            accelerator.load_state(folder)
        messages.append(str(caught.value))
    return messages


def _tampered_metadata(folder: Path, marker: Path) -> None:
    """Give a DCP folder a ``.metadata`` that runs code when unpickled (a plain pickle, as torch writes it)."""
    metadata = safe_dcp.read_metadata(folder)
    metadata.storage_meta = _Payload(marker)
    with open(folder / ".metadata", "wb") as stream:
        pickle.dump(metadata, stream)


@pytest.mark.distributed
def test_a_pickle_payload_in_an_accelerate_fsdp_checkpoint_is_refused(accelerate_checkpoints, tmp_path):
    root, _ = accelerate_checkpoints
    marker = tmp_path / "payload_ran"
    folders = [tmp_path / name for name in ("model_payload", "optimizer_payload", "metadata_payload")]
    for folder, name in zip(folders[:2], ("pytorch_model_fsdp.bin", "optimizer.bin"), strict=True):
        shutil.copytree(root / "full", folder)
        state = torch.load(folder / name, weights_only=True)
        state["payload"] = _Payload(marker)
        torch.save(state, folder / name)
    shutil.copytree(root / "sharded", folders[2])
    _tampered_metadata(folders[2] / "pytorch_model_fsdp_0", marker)
    (messages,) = run_distributed(_refused_messages, 1, 1, [str(f) for f in folders])
    assert "pytorch_model_fsdp.bin holds Python objects that cannot be loaded safely" in messages[0]
    assert "optimizer.bin holds Python objects that cannot be loaded safely" in messages[1]
    assert "pytorch_model_fsdp_0/.metadata refers to posix.mkdir, which is not part of" in messages[2]
    assert not marker.exists()


def test_a_pickle_payload_in_a_dcp_folder_is_refused(accelerate_checkpoints, tmp_path):
    root, _ = accelerate_checkpoints
    marker = tmp_path / "payload_ran"
    folder = tmp_path / "optimizer_0"
    shutil.copytree(root / "sharded" / "optimizer_0", folder)
    assert safe_dcp.check_folder(folder).state_dict_metadata  # the untouched folder passes
    _tampered_metadata(folder, marker)
    with pytest.raises(
        UnsafeCheckpointError, match=r"\.metadata refers to posix\.mkdir, which is not part of"
    ):
        safe_dcp.check_folder(folder)
    assert not marker.exists()


def test_a_pickle_payload_in_a_dcp_value_is_refused(tmp_path):
    import warnings

    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "payload_ran"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # saving without a process group: torch says so
        dcp.save(
            {"weight": torch.ones(2), "groups": [_Payload(marker)]},
            checkpoint_id=tmp_path / "c",
            no_dist=True,
        )
    with pytest.raises(
        UnsafeCheckpointError,
        match=r"the value 'groups' holds Python objects .* \(Trying to load unsupported GLOBAL posix\.mkdir whose module posix is blocked\)\. Load only",
    ):
        safe_dcp.check_folder(tmp_path / "c")
    with pytest.raises(UnsafeCheckpointError, match="the value 'groups'"):
        safe_dcp.load({"weight": torch.zeros(2), "groups": None}, tmp_path / "c", no_dist=True)
    assert not marker.exists()


# -- Accelerate reads lockstep's FSDP checkpoints ------------------------------------------------------
def _train_prepared(accelerator: Accelerator, seed: int = 0):
    model = make_transformer(seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    for batch in data_loader(16, 4):
        accelerator.backward(loss_of(model, batch))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return model, optimizer


def _save_with_lockstep_then_read_like_accelerate(world: int, folder: str) -> tuple[dict, dict]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    accelerator = _fsdp_accelerator("SHARDED_STATE_DICT")
    model, optimizer = _train_prepared(accelerator)
    accelerator.save_state(folder)
    saved = {"params": full_params(model), "optimizer": _optimizer_state(model, optimizer)}
    # Accelerate's load_fsdp_model / load_fsdp_optimizer (FSDP2), on a model sharded by torch alone
    plain = _plain_fsdp_model(seed=7)
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    state = {"model": get_model_state_dict(plain)}
    reader = FileSystemReader(str(Path(folder) / "pytorch_model_fsdp_0"))
    dcp.load(state, storage_reader=reader, planner=DefaultLoadPlanner())
    set_model_state_dict(plain, state["model"])
    state = {"optimizer": get_optimizer_state_dict(plain, plain_optimizer)}
    dcp.load(
        state,
        storage_reader=FileSystemReader(str(Path(folder) / "optimizer_0")),
        planner=DefaultLoadPlanner(),
    )
    set_optimizer_state_dict(plain, plain_optimizer, state["optimizer"])
    return saved, {"params": full_params(plain), "optimizer": _optimizer_state(plain, plain_optimizer)}


def _stored(folder: Path) -> tuple[set, dict]:
    metadata = safe_dcp.read_metadata(folder)
    return set(metadata.state_dict_metadata), metadata.planner_data


@pytest.mark.distributed
def test_accelerate_reads_locksteps_sharded_fsdp_checkpoint(accelerate_checkpoints, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    root, _ = accelerate_checkpoints
    folder = tmp_path / "lockstep_ckpt"
    results = run_distributed(_save_with_lockstep_then_read_like_accelerate, 2, 2, str(folder))
    for saved, read in results:
        assert torch.equal(read["params"], saved["params"])
        assert read["optimizer"].keys() == saved["optimizer"].keys()
        for key, value in saved["optimizer"].items():
            assert torch.equal(read["optimizer"][key], value), key
    for name in ("pytorch_model_fsdp_0", "optimizer_0"):  # the very keys Accelerate writes
        assert _stored(folder / name) == _stored(root / "sharded" / name)
    layout.verify(folder)  # and lockstep's manifest covers the same files
    assert {"random_states_0.pkl", "random_states_1.pkl", "scheduler.bin"} <= {
        p.name for p in folder.iterdir()
    }
    # Accelerate's merge_fsdp_weights: DCP to one torch file, then the single top-level key unwrapped
    dcp_to_torch_save(folder / "pytorch_model_fsdp_0", tmp_path / "merged.bin")
    (merged,) = torch.load(tmp_path / "merged.bin", weights_only=True).values()
    reference = make_transformer(seed=3)
    reference.load_state_dict(merged)
    assert torch.equal(full_params(reference), results[0][0]["params"])


def _full_save_converted_then_read_like_accelerate(world: int, folder: str) -> tuple[dict, dict]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from lockstep.checkpoint import load_model_files

    accelerator = _fsdp_accelerator("FULL_STATE_DICT")
    model, optimizer = _train_prepared(accelerator)
    accelerator.save_state(folder)
    saved = {"params": full_params(model), "optimizer": _optimizer_state(model, optimizer)}
    # The conversion docs/how-to/checkpoints.md gives: Accelerate looks for the model in pytorch_model_fsdp.bin
    torch.save(load_model_files(folder), Path(folder) / "pytorch_model_fsdp.bin")
    layout.verify(Path(folder))  # the added file leaves lockstep's manifest valid
    # Accelerate's load_fsdp_model / load_fsdp_optimizer (FSDP2, FULL_STATE_DICT)
    plain = _plain_fsdp_model(seed=7)
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    torch.optim.lr_scheduler.StepLR(plain_optimizer, step_size=1, gamma=0.5)  # as prepared: initial_lr
    options = StateDictOptions(full_state_dict=True)
    whole = torch.load(Path(folder) / "pytorch_model_fsdp.bin", weights_only=True)
    set_model_state_dict(plain, whole, options=options)
    whole = torch.load(Path(folder) / "optimizer.bin", weights_only=True)
    set_optimizer_state_dict(plain, plain_optimizer, whole, options=options)
    return saved, {"params": full_params(plain), "optimizer": _optimizer_state(plain, plain_optimizer)}


@pytest.mark.distributed
def test_accelerate_reads_locksteps_full_fsdp_checkpoint_once_the_model_is_converted(tmp_path):
    ((saved, read),) = run_distributed(
        _full_save_converted_then_read_like_accelerate, 1, 1, str(tmp_path / "ckpt")
    )
    assert torch.equal(read["params"], saved["params"])
    for key, value in saved["optimizer"].items():
        assert torch.equal(read["optimizer"][key], value), key


# -- Accelerate's FSDP helpers ------------------------------------------------------------------------
def _helpers_round_trip(world: int, root: str) -> dict:
    accelerator = _fsdp_accelerator("SHARDED_STATE_DICT")
    model, optimizer = _train_prepared(accelerator)
    expected = {"params": full_params(model), "optimizer": _optimizer_state(model, optimizer)}
    loaded = {}
    for kind in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
        plugin = FullyShardedDataParallelPlugin(state_dict_type=kind)
        folder = Path(root) / kind
        save_fsdp_model(plugin, accelerator, model, folder)
        save_fsdp_optimizer(plugin, accelerator, optimizer, model, folder)
        other = make_transformer(seed=7)
        other_optimizer = torch.optim.AdamW(other.parameters(), lr=1e-2)
        other, other_optimizer = accelerator.prepare(other, other_optimizer)
        keys = load_fsdp_model(plugin, accelerator, other, folder)
        load_fsdp_optimizer(plugin, accelerator, other_optimizer, other, folder)
        loaded[kind] = {
            "keys": (keys.missing_keys, keys.unexpected_keys),
            "params": full_params(other),
            "optimizer": _optimizer_state(other, other_optimizer),
        }
    return {"expected": expected, "loaded": loaded}


@pytest.mark.distributed
def test_save_and_load_fsdp_helpers_write_and_read_accelerates_layout(accelerate_checkpoints, tmp_path):
    root, _ = accelerate_checkpoints
    result = run_distributed(_helpers_round_trip, 2, 2, str(tmp_path))[0]
    sharded, full = tmp_path / "SHARDED_STATE_DICT", tmp_path / "FULL_STATE_DICT"
    assert sorted(p.name for p in sharded.iterdir()) == ["optimizer_0", "pytorch_model_fsdp_0"]
    for name in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert _stored(sharded / name) == _stored(root / "sharded" / name)
    assert sorted(p.name for p in full.iterdir()) == ["optimizer.bin", "pytorch_model_fsdp.bin"]
    whole = torch.load(full / "pytorch_model_fsdp.bin", weights_only=True)
    assert whole.keys() == torch.load(root / "full" / "pytorch_model_fsdp.bin", weights_only=True).keys()
    optimizer = torch.load(full / "optimizer.bin", weights_only=True)
    assert optimizer["param_groups"][0]["params"] == list(whole)  # keyed by parameter name, as Accelerate's
    expected = result["expected"]
    for kind, loaded in result["loaded"].items():
        assert loaded["keys"] == ([], []), kind
        assert torch.equal(loaded["params"], expected["params"]), kind
        for key, value in expected["optimizer"].items():
            assert torch.equal(loaded["optimizer"][key], value), (kind, key)


def test_fsdp_helpers_say_what_is_wrong(tmp_path):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"state_dict_type='LOCAL_STATE_DICT' is not supported: FSDP2"):
        save_fsdp_model(SimpleNamespace(state_dict_type="LOCAL_STATE_DICT"), None, model, tmp_path)
    with pytest.raises(TypeError, match=r"load_fsdp_model\(fsdp_plugin=None\): pass the FSDP plugin"):
        load_fsdp_model(None, None, model, tmp_path)
    plugin = FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT")
    with pytest.raises(
        FileNotFoundError, match=r"optimizer_0 is not a sharded checkpoint \(\.metadata is missing\)"
    ):
        load_fsdp_optimizer(plugin, None, torch.optim.SGD(model.parameters(), lr=0.1), model, tmp_path)


def test_lockstep_checkpoints_saved_before_the_model_key_still_load(accelerate_checkpoints, tmp_path):
    import warnings

    import torch.distributed.checkpoint as dcp

    from lockstep.backends.fsdp.checkpoint import _model_holder, read_full_weights

    root, saved = accelerate_checkpoints
    accelerate_folder = root / "sharded" / "pytorch_model_fsdp_0"
    weights = read_full_weights(accelerate_folder)  # the "model" level is dropped
    assert weights.keys() == saved[0]["full"].keys()
    assert all(torch.equal(weights[k], v) for k, v in saved[0]["full"].items())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # saving without a process group: torch says so
        dcp.save(dict(weights), checkpoint_id=tmp_path / "old", no_dist=True)  # lockstep's layout before
    old = read_full_weights(tmp_path / "old")
    assert old.keys() == weights.keys()
    template = dict.fromkeys(weights)
    assert _model_holder(template, accelerate_folder) == {"model": template}
    assert _model_holder(template, tmp_path / "old") is template
    with pytest.raises(
        ValueError, match=r"does not hold this model's weights: 1 of its 23 keys are not in it"
    ):
        _model_holder({**template, "extra.weight": None}, accelerate_folder)
