"""``lockstep.utils.modeling`` and ``lockstep.big_modeling``: sizes, ties, moving tensors one by one, building
models without memory, and loading checkpoints into them (sharded, tied, cast, strict)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from lockstep.big_modeling import init_empty_weights, init_on_device
from lockstep.checkpoint.model_files import save_model_files
from lockstep.errors import UnsafeCheckpointError
from lockstep.state import AcceleratorState
from lockstep.utils import modeling
from lockstep.utils.dataclasses import CustomDtype
from tests.helpers.multiprocess import run_distributed


class Tied(nn.Module):
    """An embedding tied to an output head, a norm with buffers, and an integer buffer."""

    _no_split_modules = ["Block"]

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.block = Block()
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("steps", torch.zeros(3, dtype=torch.long))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(4)
        self.proj = nn.Linear(4, 4)


def _filled(seed: int) -> Tied:
    torch.manual_seed(seed)
    model = Tied()
    with torch.no_grad():
        model.block.norm.running_mean.uniform_()
        model.steps += seed
    return model


# -- sizes -------------------------------------------------------------------------------------------------
def test_dtype_byte_size():
    assert modeling.dtype_byte_size(torch.float32) == 4
    assert modeling.dtype_byte_size("bfloat16") == 2
    assert modeling.dtype_byte_size("torch.int64") == 8
    assert modeling.dtype_byte_size(torch.bool) == 0.125
    assert modeling.dtype_byte_size(torch.float8_e4m3fn) == 1
    assert modeling.dtype_byte_size(CustomDtype.INT4) == 0.5
    with pytest.raises(ValueError, match="dtype 'float13' is not a torch dtype"):
        modeling.dtype_byte_size("float13")


def test_id_tensor_storage_is_shared_by_views_only():
    weight = torch.zeros(6)
    assert modeling.id_tensor_storage(weight.view(2, 3)) == modeling.id_tensor_storage(weight)
    assert modeling.id_tensor_storage(torch.zeros(6)) != modeling.id_tensor_storage(weight)
    meta = torch.empty(3, device="meta")
    assert modeling.id_tensor_storage(meta) == (torch.device("meta"), 0, 12)


def test_named_module_tensors_and_non_persistent_buffers():
    model = nn.Module()
    model.layer = nn.Linear(2, 2)
    model.register_buffer("scratch", torch.zeros(1), persistent=False)
    model.layer.register_buffer("kept", torch.zeros(1))
    assert [n for n, _ in modeling.named_module_tensors(model)] == ["scratch"]
    names = [n for n, _ in modeling.named_module_tensors(model, recurse=True, remove_non_persistent=True)]
    assert names == ["layer.weight", "layer.bias", "layer.kept"]
    assert modeling.get_non_persistent_buffers(model, recurse=True) == {"scratch"}
    assert model._non_persistent_buffers_set == {"scratch"}  # not modified (Accelerate's version grows it)


def test_compute_module_sizes_counts_each_tensor_once():
    sizes = modeling.compute_module_sizes(Tied())
    # embed 40 floats (head shares it), norm 4+4 weights and 4+4 running stats + 1 long, proj 20, steps 3 longs
    assert sizes["embed"] == 160 and sizes["head"] == 0
    assert sizes["block.norm"] == 16 * 4 + 8 and sizes["block.proj"] == 80
    assert sizes[""] == 160 + 72 + 80 + 24
    half = modeling.compute_module_sizes(Tied(), dtype=torch.float16)
    assert half["embed"] == 80 and half["steps"] == 24  # integers are never cast
    special = modeling.compute_module_sizes(
        Tied(), dtype="float16", special_dtypes={"embed.weight": "float32"}
    )
    assert special["embed"] == 160
    assert modeling.compute_module_sizes(Tied(), buffers_only=True)[""] == 32 + 8 + 24
    assert modeling.compute_module_total_buffer_size(Tied()) == 64


def test_largest_layer_respects_no_split_classes():
    model = Tied()
    sizes = modeling.compute_module_sizes(model)
    block = [("block", model.block)]
    assert modeling.get_max_layer_size(block, sizes, []) == (80, ["block.proj"])
    assert modeling.get_max_layer_size(block, sizes, ["Block"]) == (152, ["block"])
    children = list(model.named_children())
    assert modeling.get_max_layer_size(children, sizes, []) == (160, ["embed"])
    model.embed = nn.Embedding(19, 2)  # 152 bytes: as large as the unsplit block
    sizes = modeling.compute_module_sizes(model)
    total, largest = modeling.calculate_maximum_sizes(model)  # model._no_split_modules = ["Block"]
    assert total == sizes[""] and largest == (160, ["head"])
    model.head = nn.Linear(2, 1, bias=False)
    assert modeling.calculate_maximum_sizes(model)[1] == (152, ["embed", "block"])


# -- ties ---------------------------------------------------------------------------------------------------
def test_find_and_retie_parameters():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    model[2].weight = model[0].weight
    model[1].weight = model[0].weight
    model[2].bias = model[1].bias
    assert modeling.find_tied_parameters(model) == [
        ["0.weight", "1.weight", "2.weight"],
        ["1.bias", "2.bias"],
    ]
    model[1].weight = nn.Parameter(model[0].weight.detach().clone())  # the tie is broken
    modeling.retie_parameters(model, [["0.weight", "1.weight", "2.weight"]])
    assert model[1].weight is model[0].weight is model[2].weight


def test_retie_takes_the_first_non_meta_parameter_and_names_bad_paths():
    model = nn.Sequential(nn.Linear(2, 2, bias=False), nn.Linear(2, 2, bias=False))
    real = model[1].weight
    model[0].weight = nn.Parameter(torch.empty(2, 2, device="meta"))
    modeling.retie_parameters(model, [["0.weight", "1.weight"]])
    assert model[0].weight is real
    with pytest.raises(ValueError, match=r"Sequential has no submodule '7' \(looking up '7.weight'\)"):
        modeling.retie_parameters(model, [["7.weight"]])


def test_device_map_checks():
    model = Tied()
    modeling.check_device_map(model, {"": "cpu"})
    with pytest.raises(ValueError, match=r"gives no device to these tensors: block.norm.weight"):
        modeling.check_device_map(model, {"embed": "cpu", "head": "cpu", "steps": "cpu", "block.proj": 0})
    with pytest.warns(UserWarning, match="Tied parameters are on different devices"):
        modeling.check_tied_parameters_on_same_device(
            [["embed.weight", "head.weight"]], {"embed": 0, "head": 1}
        )
    modeling.check_tied_parameters_on_same_device([["embed.weight", "head.weight"]], {"": "cpu"})


def test_sizes_and_memory_limits():
    assert modeling.convert_file_size_to_int("1MiB") == 2**20
    assert modeling.convert_file_size_to_int("5GB") == 5 * 10**9
    assert modeling.convert_file_size_to_int("8Mb") == 10**6  # megabits, as Accelerate
    with pytest.raises(ValueError, match=r"convert_file_size_to_int\('lots'\) is not a size"):
        modeling.convert_file_size_to_int("lots")
    assert modeling.get_max_memory({0: "1KiB", "cpu": 5}) == {0: 1024, "cpu": 5}
    with pytest.raises(ValueError, match=r"got device 'gpu0'"):
        modeling.get_max_memory({"gpu0": 1})
    assert modeling.get_max_memory()["cpu"] > 0


# -- set_module_tensor_to_device -------------------------------------------------------------------------------
def test_set_module_tensor_fills_a_meta_parameter_keeping_its_class_and_grad_flag():
    class Flagged(nn.Parameter):
        pass

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 3))
    model[0].weight = Flagged(model[0].weight, requires_grad=False)
    value = torch.arange(6, dtype=torch.float64).reshape(3, 2)
    modeling.set_module_tensor_to_device(model, "0.weight", "cpu", value=value)
    weight = model[0].weight
    assert type(weight) is Flagged and weight.requires_grad is False
    assert weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.tolist() == value.tolist()
    modeling.set_module_tensor_to_device(model, "0.bias", "cpu", value=torch.ones(3), dtype=torch.bfloat16)
    assert model[0].bias.dtype == torch.bfloat16


def test_set_module_tensor_buffers_ints_and_errors():
    model = Tied()
    modeling.set_module_tensor_to_device(
        model, "steps", "cpu", value=torch.tensor([1, 2, 3]), dtype=torch.float16
    )
    assert model.steps.dtype == torch.long and model.steps.tolist() == [1, 2, 3]  # integers are not cast
    assert "steps" in model._buffers
    with pytest.raises(
        ValueError, match=r"Cannot set block.proj.weight \(shape \(4, 4\)\) to a tensor of shape \(2,\)"
    ):
        modeling.set_module_tensor_to_device(model, "block.proj.weight", "cpu", value=torch.ones(2))
    with pytest.raises(ValueError, match=r"Linear has no parameter or buffer 'scale'"):
        modeling.set_module_tensor_to_device(model, "block.proj.scale", "cpu")
    with torch.device("meta"):
        empty = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="weight is on the meta device and has no data to move to cpu"):
        modeling.set_module_tensor_to_device(empty, "weight", "cpu")
    with pytest.raises(NotImplementedError, match="does not integrate bitsandbytes"):
        modeling.set_module_tensor_to_device(model, "head.weight", "cpu", fp16_statistics=torch.ones(1))


def test_set_module_tensor_reuses_a_tied_weight_already_placed():
    model = nn.Sequential(nn.Linear(2, 2, bias=False), nn.Linear(2, 2, bias=False))
    model[1].weight = model[0].weight
    tied_map: dict[int, dict[Any, torch.Tensor]] = {model[0].weight.data_ptr(): {}}
    modeling.set_module_tensor_to_device(model, "0.weight", "meta", tied_params_map=tied_map)
    modeling.set_module_tensor_to_device(model, "1.weight", "meta", tied_params_map=tied_map)
    assert model[0].weight.is_meta and model[1].weight is model[0].weight


def test_mixed_precision_context_and_grad_scaler():
    with modeling.get_mixed_precision_context_manager(native_amp=True):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32  # mixed_precision "no"
    AcceleratorState(mixed_precision="bf16")
    with modeling.get_mixed_precision_context_manager(native_amp=True):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with modeling.get_mixed_precision_context_manager(native_amp=False):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    scaler = modeling.get_grad_scaler(init_scale=8.0)
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.get_scale() == 8.0
    assert modeling.is_peft_model(nn.Linear(1, 1)) is False


# -- init_empty_weights / init_on_device -------------------------------------------------------------------------
def test_init_empty_weights_puts_parameters_on_meta_and_restores_torch():
    original = nn.Module.register_parameter
    with init_empty_weights():
        model = Tied()
    assert all(p.is_meta for p in model.parameters())
    assert model.block.norm.running_mean.device.type == "cpu" and model.steps.device.type == "cpu"
    assert model.head.weight is model.embed.weight  # ties made in __init__ survive
    assert nn.Module.register_parameter is original
    with pytest.raises(RuntimeError, match="inside"), init_on_device("meta"):
        raise RuntimeError("inside")
    assert nn.Module.register_parameter is original and not nn.Linear(1, 1).weight.is_meta


def test_init_with_buffers_puts_everything_on_the_device():
    with init_empty_weights(include_buffers=True):
        model = Tied()
    assert all(t.is_meta for t in model.state_dict().values())
    assert not torch.ones(1).is_meta  # the device context ended


# -- loading -----------------------------------------------------------------------------------------------
def test_load_checkpoint_into_an_empty_model_from_sharded_files(tmp_path):
    source = _filled(seed=1)
    written = save_model_files(source.state_dict(), tmp_path / "ckpt", max_shard_size=100)
    assert written[-1].name == "model.safetensors.index.json" and len(written) > 3
    with init_empty_weights():
        model = Tied()
    modeling.load_checkpoint_in_model(model, tmp_path / "ckpt", strict=True)
    for name, value in source.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    assert model.head.weight is model.embed.weight and not model.embed.weight.is_meta


def test_load_checkpoint_casts_floats_but_keeps_fp32_modules_and_integers(tmp_path):
    source = _filled(seed=2)
    save_model_files(source.state_dict(), tmp_path, safe_serialization=False)
    model = Tied()
    modeling.load_checkpoint_in_model(
        model, tmp_path / "pytorch_model.bin", dtype="bfloat16", keep_in_fp32_modules=["norm"]
    )
    assert model.embed.weight.dtype == torch.bfloat16 and model.block.proj.bias.dtype == torch.bfloat16
    assert model.block.norm.weight.dtype == torch.float32 and model.steps.dtype == torch.long
    assert torch.equal(model.steps, source.steps)


def test_load_checkpoint_key_mismatches(tmp_path):
    state = _filled(seed=3).state_dict()
    state["extra.weight"] = torch.ones(1)
    del state["block.proj.bias"], state["head.weight"]  # the head is tied to the embedding: stored once
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = _filled(seed=4)
    before = model.embed.weight.detach().clone()
    with pytest.raises(
        ValueError,
        match=r"Missing from the checkpoint \(1\): \['block.proj.bias'\]\. Unknown to the model \(1\): \['extra.weight'\]",
    ):
        modeling.load_checkpoint_in_model(model, tmp_path, strict=True)
    assert torch.equal(model.embed.weight, before)  # refused before anything was loaded
    with pytest.warns(UserWarning, match=r"Missing from the checkpoint \(1\)"):
        modeling.load_checkpoint_in_model(model, tmp_path)
    assert torch.equal(model.embed.weight, state["embed.weight"])


def test_load_checkpoint_rejects_what_lockstep_does_not_do(tmp_path):
    save_model_files(Tied().state_dict(), tmp_path)
    with pytest.raises(ValueError, match=r"sends \['embed'\] to 'disk', and no offload_folder was given"):
        modeling.load_checkpoint_in_model(Tied(), tmp_path, device_map={"embed": "disk", "": "cpu"})
    with pytest.raises(NotImplementedError, match="does not integrate bitsandbytes"):
        modeling.load_checkpoint_in_model(Tied(), tmp_path, offload_8bit_bnb=True)
    with pytest.warns(
        UserWarning, match=r"offload_state_dict=True\) is ignored: lockstep reads the checkpoint one"
    ):
        modeling.load_checkpoint_in_model(Tied(), tmp_path, offload_state_dict=True)
    with pytest.raises(ValueError, match="no such file or folder"):
        modeling.load_checkpoint_in_model(Tied(), tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        ValueError,
        match=r"needs model.safetensors, pytorch_model.bin or exactly one \*.index.json \(found none\)",
    ):
        modeling.load_checkpoint_in_model(Tied(), tmp_path / "empty")


def test_load_checkpoint_with_a_device_map(tmp_path):
    source = _filled(seed=5)
    save_model_files(source.state_dict(), tmp_path)
    with init_empty_weights():
        model = Tied()
    modeling.load_checkpoint_in_model(model, tmp_path, device_map={"": "cpu"})
    assert all(t.device.type == "cpu" for t in model.state_dict().values())
    assert torch.equal(model.block.proj.weight, source.block.proj.weight)


def test_load_state_dict_checks_formats_and_refuses_unsafe_pickles(tmp_path):
    save_file({"w": torch.ones(1)}, str(tmp_path / "tf.safetensors"), metadata={"format": "tf"})
    with pytest.raises(ValueError, match="holds tf weights"):
        modeling.load_state_dict(tmp_path / "tf.safetensors")
    save_file({"w": torch.ones(1)}, str(tmp_path / "odd.safetensors"), metadata={"format": "jax"})
    with pytest.raises(OSError, match="metadata format 'jax'"):
        modeling.load_state_dict(tmp_path / "odd.safetensors")
    save_file({"w": torch.ones(1)}, str(tmp_path / "bare.safetensors"))
    assert modeling.load_state_dict(tmp_path / "bare.safetensors")["w"].tolist() == [1.0]
    torch.save({"w": torch.ones(1), "f": Block}, tmp_path / "unsafe.bin")
    with pytest.raises(UnsafeCheckpointError, match="cannot be loaded safely"):
        modeling.load_state_dict(tmp_path / "unsafe.bin")


def _broadcast_load_worker(folder: str) -> torch.Tensor:
    from lockstep.state import PartialState

    rank = PartialState().process_index
    model = nn.Linear(3, 2)
    # Only the main process reads: the others may not even see the files.
    path = folder if rank == 0 else f"{folder}/not-there"
    modeling.load_checkpoint_in_model(model, path, broadcast_from_rank0=True, strict=True)
    return torch.cat([model.weight.detach().flatten(), model.bias.detach()])


@pytest.mark.distributed
def test_load_checkpoint_broadcast_from_rank0_in_a_real_group(tmp_path):
    torch.manual_seed(11)
    source = nn.Linear(3, 2)
    save_model_files(source.state_dict(), tmp_path)
    expected = torch.cat([source.weight.detach().flatten(), source.bias.detach()])
    for loaded in run_distributed(_broadcast_load_worker, 2, str(tmp_path)):
        assert torch.equal(loaded, expected)
