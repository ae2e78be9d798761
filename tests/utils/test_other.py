"""``lockstep.utils.other`` and ``.tqdm``: unwrapping models, saving on the right process, safe loading,
writing a basic config file, and the small helpers."""

from __future__ import annotations

import importlib
import io
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from lockstep import Accelerator
from lockstep.config.file import load_config_file
from lockstep.errors import UnsafeCheckpointError
from lockstep.utils import other
from tests.helpers.multiprocess import run_distributed

# lockstep.utils.tqdm is the function (as in Accelerate); its module is reached through the import system.
tqdm_module = importlib.import_module("lockstep.utils.tqdm")


# -- extract_model_from_parallel ------------------------------------------------------------------------
def test_extract_strips_data_parallel_and_compile_wrappers():
    inner = nn.Linear(2, 2)
    assert other.extract_model_from_parallel(nn.DataParallel(nn.DataParallel(inner))) is inner
    compiled = torch.compile(inner, backend="eager")
    assert other.is_compiled_module(compiled) and not other.is_compiled_module(inner)
    assert other.extract_model_from_parallel(compiled) is compiled
    assert other.extract_model_from_parallel(compiled, keep_torch_compile=False) is inner
    around = torch.compile(nn.DataParallel(inner), backend="eager")
    kept = other.extract_model_from_parallel(around)
    assert other.is_compiled_module(kept) and kept._orig_mod is inner
    assert around._orig_mod.module is inner  # the caller's compiled model is left as it was


def test_extract_recursive_unwraps_children():
    inner = nn.Linear(2, 2)
    outer = nn.Sequential(nn.DataParallel(inner), nn.ReLU())
    assert other.has_compiled_regions(outer) is False
    extracted = other.extract_model_from_parallel(outer, recursive=True)
    assert extracted is outer and outer[0] is inner


def test_extract_removes_the_mixed_precision_wrapper_the_accelerator_installed():
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    model = accelerator.prepare(nn.Linear(2, 2))
    assert "forward" in model.__dict__
    unwrapped = other.extract_model_from_parallel(model, keep_fp32_wrapper=False)
    assert "forward" not in unwrapped.__dict__
    assert unwrapped(torch.ones(1, 2)).dtype == torch.float32  # plain fp32 forward, no autocast
    accelerator.end_training()


def test_get_module_children_bottom_up():
    model = nn.Sequential(nn.Linear(1, 1), nn.Sequential(nn.ReLU(), nn.Tanh()))
    modules = other.get_module_children_bottom_up(model)
    assert modules[-1] is model and modules.index(model[1][0]) < modules.index(model[1])


# -- save and load ------------------------------------------------------------------------------------------
def test_save_and_load_round_trip_with_numpy_arrays(tmp_path):
    data = {"step": torch.tensor(3), "rng": np.arange(4, dtype=np.uint32), "name": "run"}
    other.save(data, tmp_path / "state.pt")
    loaded = other.load(tmp_path / "state.pt")
    assert loaded["step"].item() == 3 and loaded["name"] == "run"
    assert isinstance(loaded["rng"], np.ndarray) and loaded["rng"].tolist() == [0, 1, 2, 3]
    assert [p.name for p in tmp_path.iterdir()] == ["state.pt"]  # no temporary file left behind


def test_load_refuses_arbitrary_objects_unless_asked(tmp_path):
    torch.save({"cls": nn.Linear}, tmp_path / "unsafe.pt")
    with pytest.raises(
        UnsafeCheckpointError, match=r"unsafe.pt'\) refused to unpickle .* weights_only=False"
    ):
        other.load(tmp_path / "unsafe.pt")
    assert other.load(tmp_path / "unsafe.pt", weights_only=False)["cls"] is nn.Linear


def test_save_safetensors_drops_shared_tensors_and_writes_file_objects(tmp_path):
    weight = torch.arange(4.0)
    other.save(
        {"embed": weight, "head": weight, "bias": torch.ones(1)},
        tmp_path / "m.safetensors",
        safe_serialization=True,
    )
    assert sorted(load_file(str(tmp_path / "m.safetensors"))) == ["bias", "embed"]
    buffer = io.BytesIO()
    other.save({"w": weight}, buffer)
    buffer.seek(0)
    assert torch.equal(other.load(buffer)["w"], weight)
    with pytest.raises(TypeError, match=r"stores a dict of str -> tensor, got a list"):
        other.save([weight], tmp_path / "x.safetensors", safe_serialization=True)


def _save_worker(folder: str, on_each_node: bool) -> list[str]:
    from lockstep.state import PartialState

    state = PartialState()
    other.save(
        {"rank": torch.tensor(state.process_index)},
        f"{folder}/r{state.process_index}.pt",
        save_on_each_node=on_each_node,
    )
    state.wait_for_everyone()
    return sorted(p.name for p in Path(folder).iterdir())


@pytest.mark.distributed
def test_save_writes_on_the_main_process_only(tmp_path):
    for files in run_distributed(_save_worker, 2, str(tmp_path), False):
        assert files == ["r0.pt"]
    assert other.load(tmp_path / "r0.pt")["rank"].item() == 0


# -- write_basic_config -------------------------------------------------------------------------------------
def test_write_basic_config_for_this_machine_and_never_overwrites(tmp_path, capsys):
    path = tmp_path / "cfg" / "default_config.yaml"
    assert other.write_basic_config(mixed_precision="bf16", save_location=path) == path
    config = load_config_file(path)
    assert config.mixed_precision == "bf16" and config.compute_environment == "LOCAL_MACHINE"
    if not torch.cuda.is_available():
        assert config.distributed_type == "NO" and config.num_processes == 1 and config.use_cpu is True
    path.write_text("# mine\n")
    assert other.write_basic_config(save_location=path) is False
    assert path.read_text() == "# mine\n"
    assert "already exists" in capsys.readouterr().out


def test_write_basic_config_default_location_and_bad_precision(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCKSTEP_HOME", str(tmp_path))
    assert other.write_basic_config() == tmp_path / "default_config.yaml"
    with pytest.raises(ValueError, match=r"mixed_precision='fp8' is not supported by lockstep"):
        other.write_basic_config("fp8", save_location=tmp_path / "other.yaml")
    with pytest.raises(ValueError, match=r"mixed_precision='fp32' is invalid"):
        other.write_basic_config("fp32", save_location=tmp_path / "other.yaml")


# -- helpers --------------------------------------------------------------------------------------------------
def test_small_helpers():
    assert other.convert_bytes(1023) == "1023 bytes"
    assert other.convert_bytes(1024**2 * 1.5) == "1.5 MB"
    assert other.convert_bytes(1024**5 * 3) == "3.0 PB"
    assert other.get_pretty_name(nn.Linear) == "Linear" and other.get_pretty_name(nn.Linear(1, 1)) == "Linear"
    merged = other.merge_dicts({"a": {"b": 1, "c": {"d": 2}}, "e": 3}, {"a": {"x": 0, "c": {"y": 1}}})
    assert merged == {"a": {"x": 0, "b": 1, "c": {"y": 1, "d": 2}}, "e": 3}
    model = nn.Sequential(nn.Linear(2, 3))
    assert other.recursive_getattr(model, "0.weight").shape == (3, 2)


def test_ports():
    port = other.get_free_port()
    assert other.is_port_in_use(port) is False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("localhost", port))
        listener.listen(1)
        assert other.is_port_in_use(port) is True


def test_check_os_kernel_warns_on_old_linux(monkeypatch, caplog):
    uname = type("Uname", (), {"system": "Linux", "release": "4.15.0-213-generic"})
    monkeypatch.setattr(other.platform, "uname", lambda: uname)
    other.check_os_kernel()
    assert "Detected kernel version 4.15.0" in caplog.text
    caplog.clear()
    uname.release = "6.8.0-45-generic"
    other.check_os_kernel()
    assert caplog.text == ""


def test_tqdm_shows_on_the_main_process_only(monkeypatch):
    bar = tqdm_module.tqdm(range(3), file=io.StringIO())
    assert bar.disable is False and list(bar) == [0, 1, 2]
    assert tqdm_module.tqdm(range(3), disable=True).disable is True
    monkeypatch.setattr(tqdm_module.PartialState, "local_process_index", property(lambda self: 1))
    assert tqdm_module.tqdm(range(3)).disable is True
    assert tqdm_module.tqdm(range(3), main_process_only=False, file=io.StringIO()).disable is False
