"""``lockstep.utils.offload`` and the modeling helpers around it: weights written to disk in Accelerate's
disk-offload layout (``<name>.dat`` memory maps and ``index.json``) read back exactly, as a mapping or into a
model; ``align_module_device`` and ``has_offloaded_params``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from lockstep.utils import modeling, offload

TENSORS = {
    "float": torch.arange(6, dtype=torch.float32).reshape(2, 3) / 7,
    "bf16": torch.tensor([1.5, -2.25, 3.0e5], dtype=torch.bfloat16),
    "half": torch.tensor([[0.1, 0.2]], dtype=torch.float16),
    "ints": torch.tensor([3, -4], dtype=torch.int64),
    "flags": torch.tensor([True, False]),
    "scalar": torch.tensor(2.5),
}


# -- the folder format ----------------------------------------------------------------------------------
def test_every_dtype_and_a_scalar_round_trip_bit_for_bit(tmp_path):
    offload.offload_state_dict(tmp_path / "folder", TENSORS)
    index = json.loads((tmp_path / "folder" / "index.json").read_text())
    assert index["bf16"] == {"dtype": "bfloat16", "shape": [3]}
    assert index["scalar"] == {"dtype": "float32", "shape": []}
    assert index["float"] == {"dtype": "float32", "shape": [2, 3]}
    for name, tensor in TENSORS.items():
        loaded = offload.load_offloaded_weight(tmp_path / "folder" / f"{name}.dat", index[name])
        assert loaded.dtype == tensor.dtype and loaded.shape == tensor.shape, name
        assert torch.equal(loaded, tensor), name


def test_the_files_are_raw_bytes_as_accelerate_writes_them(tmp_path):
    index = offload.offload_weight(TENSORS["bf16"], "layer.weight", tmp_path, index={})
    raw = np.fromfile(tmp_path / "layer.weight.dat", dtype=np.int16)  # bf16 bits stored as int16
    assert raw.tolist() == TENSORS["bf16"].view(torch.int16).tolist()
    assert index == {"layer.weight": {"dtype": "bfloat16", "shape": [3]}}
    offload.offload_weight(torch.tensor(7.0), "step", tmp_path)  # without an index: only the file
    assert np.fromfile(tmp_path / "step.dat", dtype=np.float32).tolist() == [7.0]  # a scalar takes 1 element


def test_save_offload_index_merges_into_the_existing_index(tmp_path):
    offload.save_offload_index({"a": {"dtype": "float32", "shape": [1]}}, tmp_path)
    offload.save_offload_index({"b": {"dtype": "int64", "shape": [2]}}, tmp_path)
    offload.save_offload_index({}, tmp_path)  # nothing to write
    offload.save_offload_index(None, tmp_path)
    assert json.loads((tmp_path / "index.json").read_text()) == {
        "a": {"dtype": "float32", "shape": [1]},
        "b": {"dtype": "int64", "shape": [2]},
    }


# -- reading as a mapping -------------------------------------------------------------------------------
def test_the_loader_reads_memory_then_disk_then_safetensors(tmp_path):
    offload.offload_state_dict(tmp_path, {"disk": torch.ones(2), "both": torch.zeros(1)})
    save_file({"stored": torch.full((2,), 4.0)}, tmp_path / "part.safetensors")
    index = json.loads((tmp_path / "index.json").read_text())
    index["lazy"] = {"safetensors_file": str(tmp_path / "part.safetensors"), "weight_name": "stored"}
    index["cast"] = {**index["lazy"], "dtype": "float16"}
    loader = offload.OffloadedWeightsLoader(
        state_dict={"both": torch.full((1,), 9.0)}, save_folder=tmp_path, index=index
    )
    assert list(loader) == ["both", "disk", "lazy", "cast"] and len(loader) == 4
    assert loader["both"].tolist() == [9.0]  # memory wins over the index
    assert loader["disk"].tolist() == [1.0, 1.0]
    assert loader["lazy"].tolist() == [4.0, 4.0] and loader["cast"].dtype == torch.float16
    assert dict(offload.OffloadedWeightsLoader(save_folder=tmp_path))["both"].tolist() == [0.0]
    with pytest.raises(KeyError):
        loader["missing"]


def test_the_loader_needs_weights():
    with pytest.raises(ValueError, match=r"OffloadedWeightsLoader\(\) needs weights: pass state_dict="):
        offload.OffloadedWeightsLoader()


def test_prefixed_dataset_and_submodule_extraction():
    weights = {"h.1.weight": 1, "h.1.bias": 2, "h.10.weight": 3, "head": 4}
    view = offload.PrefixedDataset(weights, "h.1.")
    assert (view["weight"], view["bias"]) == (1, 2)
    assert list(view) == ["h.1.weight", "h.1.bias"] and len(view) == 4  # len is the whole mapping's
    with pytest.raises(KeyError):
        view["missing"]
    assert offload.extract_submodules_state_dict(weights, ["h.1", "head"]) == {
        "h.1.weight": 1,
        "h.1.bias": 2,
        "head": 4,
    }
    assert offload.extract_submodules_state_dict(weights, ["h.1"]) == {"h.1.weight": 1, "h.1.bias": 2}
    assert offload.extract_submodules_state_dict(weights, ["hea"]) == {}  # whole names only, not prefixes


# -- into a model -----------------------------------------------------------------------------------------
def test_load_offloaded_weights_fills_a_model_built_on_meta(tmp_path):
    source = nn.Sequential(nn.Linear(3, 2), nn.LayerNorm(2))
    offload.offload_state_dict(tmp_path, source.state_dict())
    with torch.device("meta"):
        target = nn.Sequential(nn.Linear(3, 2), nn.LayerNorm(2))
    index = json.loads((tmp_path / "index.json").read_text())
    modeling.load_offloaded_weights(target, index, tmp_path)
    for name, tensor in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], tensor), name
    assert isinstance(target[0].weight, nn.Parameter) and target[0].weight.device.type == "cpu"
    modeling.load_offloaded_weights(target, {}, tmp_path)  # an empty index is nothing to do


def test_load_offloaded_weights_refuses_bitsandbytes_statistics(tmp_path):
    index = {"0.weight": {"dtype": "int8", "shape": [2, 3]}, "0.SCB": {"dtype": "float32", "shape": [2]}}
    with pytest.raises(NotImplementedError, match=r"8-bit statistics \('0.SCB'\).*does not integrate"):
        modeling.load_offloaded_weights(nn.Sequential(nn.Linear(3, 2)), index, tmp_path)


# -- align_module_device and offload hooks ------------------------------------------------------------------
class FakeOffloadHook:
    """What Accelerate's AlignDevicesHook offers: a flag, the execution device, and the two calls."""

    def __init__(self, offload: bool) -> None:
        self.offload = offload
        self.execution_device = "cuda:0"
        self.calls: list[tuple[str, str]] = []

    def pre_forward(self, module: nn.Module) -> None:
        self.calls.append(("pre", str(self.execution_device)))

    def post_forward(self, module: nn.Module, output: object) -> None:
        self.calls.append(("post", str(self.execution_device)))


def test_has_offloaded_params_recognises_an_offloading_hook():
    layer = nn.Linear(2, 2)
    assert modeling.has_offloaded_params(layer) is False
    layer._hf_hook = FakeOffloadHook(offload=False)
    assert modeling.has_offloaded_params(layer) is False
    layer._hf_hook = FakeOffloadHook(offload=True)
    assert modeling.has_offloaded_params(layer) is True
    layer._hf_hook = type("CpuOffload", (), {"offload": True})()  # no pre/post_forward: not such a hook
    assert modeling.has_offloaded_params(layer) is False


def test_align_module_device_lets_the_hook_onload_and_restores_its_device():
    layer = nn.Linear(2, 2)
    hook = layer._hf_hook = FakeOffloadHook(offload=True)
    with modeling.align_module_device(layer, execution_device="cpu"):
        assert hook.calls == [("pre", "cpu")]
    assert hook.calls == [("pre", "cpu"), ("post", "cpu")] and hook.execution_device == "cuda:0"
    with pytest.raises(RuntimeError, match="inside"), modeling.align_module_device(layer):
        raise RuntimeError("inside")
    assert hook.calls[-2:] == [("pre", "cuda:0"), ("post", "cuda:0")]  # offloaded again after an error


def test_align_module_device_moves_the_modules_own_parameters_and_back(monkeypatch):
    model = nn.Sequential(nn.Linear(2, 2))
    model.register_parameter("scale", nn.Parameter(torch.ones(1)))
    moves: list[tuple[str, str]] = []
    real = modeling.set_module_tensor_to_device

    def recording(module: nn.Module, name: str, device: object, **kwargs: object) -> None:
        moves.append((name, str(device)))
        real(module, name, "cpu", **kwargs)  # this machine has only the CPU

    monkeypatch.setattr(modeling, "set_module_tensor_to_device", recording)
    with modeling.align_module_device(model, "cuda:1"):
        assert moves == [("scale", "cuda:1")]  # its own parameter, not its children's
    assert moves == [("scale", "cuda:1"), ("scale", "cpu")]
    with modeling.align_module_device(model):  # no hook and no device: nothing moves
        pass
    assert len(moves) == 2
    with modeling.align_module_device(model, "cpu"):  # for real, on the CPU: the values are kept
        assert model.scale.tolist() == [1.0]
