"""Checksums verified in the pass that reads a checkpoint's model and optimizer files (issue 29, item 2)."""

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lockstep import Accelerator
from lockstep.checkpoint import layout, single_pass


def _optimizer_state() -> dict:
    """An Adam state dict with the shapes a real one has, and the cases torch.save handles specially: two
    tensors sharing one storage, a strided view, a 0-dim tensor, bfloat16, an empty tensor, a Parameter."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 3))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 64)).sum().backward()
    optimizer.step()
    state = optimizer.state_dict()
    shared = torch.arange(40, dtype=torch.float32)
    state["extra"] = {
        "head": shared[:10],
        "tail": shared[10:].view(6, 5).t(),
        "scalar": torch.tensor(3.5),
        "half": torch.randn(7, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 4),
        "parameter": torch.nn.Parameter(torch.randn(2, 2)),
        "list": [torch.ones(3), (torch.zeros(2), 4)],
    }
    return state


def _assert_same(loaded, expected) -> None:
    if isinstance(expected, torch.Tensor):
        assert type(loaded) is type(expected)
        assert loaded.dtype == expected.dtype and loaded.shape == expected.shape
        assert loaded.stride() == expected.stride() and loaded.storage_offset() == expected.storage_offset()
        assert loaded.untyped_storage().nbytes() == expected.untyped_storage().nbytes()
        assert torch.equal(loaded, expected)
    elif isinstance(expected, dict):
        assert list(loaded) == list(expected)
        for key in expected:
            _assert_same(loaded[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert type(loaded) is type(expected) and len(loaded) == len(expected)
        for item, want in zip(loaded, expected):
            _assert_same(item, want)
    else:
        assert loaded == expected


def _checks(path: Path) -> single_pass.ReadChecks:
    return single_pass.ReadChecks(expected={path.resolve(): layout.xxh3_128_of(path)})


def test_a_torch_file_read_in_one_pass_equals_torch_load_and_records_its_checksum(tmp_path):
    path = tmp_path / "optimizer.bin"
    torch.save(_optimizer_state(), path)
    checks = _checks(path)
    with single_pass.hashing_reads(checks), torch.serialization.safe_globals([]):
        loaded = single_pass.load_torch_file(path)
    expected = torch.load(path, weights_only=True)
    _assert_same(loaded, expected)  # every storage its own, of torch.load's size: nothing shares a buffer
    extra = loaded["extra"]
    assert extra["head"].untyped_storage().data_ptr() == extra["tail"].untyped_storage().data_ptr()
    assert checks.computed == checks.expected


def test_a_corrupt_torch_file_is_refused_before_its_contents_are_returned(tmp_path):
    path = tmp_path / "optimizer.bin"
    torch.save(_optimizer_state(), path)
    checks = _checks(path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with single_pass.hashing_reads(checks), pytest.raises(single_pass.ChecksumMismatch, match="corrupt"):
        single_pass.load_torch_file(path)


def test_a_safetensors_file_is_read_into_the_tensors_given_and_hashed(tmp_path):
    path = tmp_path / "model.safetensors"
    torch.manual_seed(1)
    saved = {
        "a.weight": torch.randn(300, 200),
        "a.bias": torch.randn(200),
        "b": torch.randn(5, dtype=torch.float16),
        "c": torch.arange(6, dtype=torch.int64).view(2, 3),
    }
    save_file(saved, str(path), metadata={"note": "x"})
    into = {
        "a.weight": torch.zeros(300, 200),  # fits: read in place
        "a.bias": torch.zeros(200, dtype=torch.float64),  # another dtype: a new tensor
        "b": torch.zeros(5, 2, dtype=torch.float16)[:, 0],  # not contiguous: a new tensor
    }
    checks, header = _checks(path), []
    with single_pass.hashing_reads(checks):
        tensors, metadata = single_pass.read_safetensors(
            path, into, check=lambda names, meta: header.append((names, meta))
        )
    assert checks.computed == checks.expected
    assert metadata == {"note": "x"}
    assert tensors["a.weight"].data_ptr() == into["a.weight"].data_ptr()
    assert torch.equal(into["a.weight"], saved["a.weight"])
    for key in ("a.bias", "b", "c"):
        assert tensors[key].data_ptr() != (into[key].data_ptr() if key in into else 0)
    with safe_open(path, framework="pt") as handle:
        for key in handle.keys():
            assert torch.equal(tensors[key], handle.get_tensor(key)), key
    [(keys, metadata)] = header
    assert sorted(keys) == sorted(saved) and metadata == {"note": "x"}


def test_a_truncated_safetensors_file_is_a_clear_error(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.randn(100)}, str(path))
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ValueError, match="model.safetensors is not a valid safetensors file.*ended at byte"):
        single_pass.read_safetensors(path, {})


def test_load_state_reads_the_model_and_optimizer_files_once_into_their_tensors(tmp_path, monkeypatch):
    """The two-pass hasher never sees the model and optimizer files (the loader hashed them as it read
    them), the parameters are filled where they are, and the optimizer's state tensors own their storages."""
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    for _ in range(2):
        accelerator.backward(model(torch.randn(8, 256)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    folder = Path(accelerator.save_state(str(tmp_path / "ckpt")))
    accelerator.wait_for_everyone()
    weights = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    moments = [state["exp_avg"].clone() for state in optimizer.state_dict()["state"].values()]
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
    pointers = {name: tensor.data_ptr() for name, tensor in model.state_dict().items()}
    hashed_apart = []
    original = layout.xxh3_128_of
    monkeypatch.setattr(
        layout, "xxh3_128_of", lambda path: hashed_apart.append(Path(path).name) or original(path)
    )
    monkeypatch.setitem(layout.CHECKSUMS, "xxh3_128", layout.xxh3_128_of)

    accelerator.load_state(str(folder))

    assert "model.safetensors" not in hashed_apart and "optimizer.bin" not in hashed_apart
    assert hashed_apart, "the other files are still hashed on the thread"
    for name, tensor in model.state_dict().items():
        assert tensor.data_ptr() == pointers[name], name
        assert torch.equal(tensor, weights[name]), name
    for state, expected in zip(optimizer.state_dict()["state"].values(), moments):
        assert torch.equal(state["exp_avg"], expected)
        assert state["exp_avg"].untyped_storage().nbytes() == expected.numel() * expected.element_size()


def _captured_load(model: torch.nn.Module, monkeypatch) -> dict:
    captured = {}
    original = model.load_state_dict

    def load_state_dict(state_dict, *args, **kwargs):
        captured.update(state_dict)
        return original(state_dict, *args, **kwargs)

    monkeypatch.setattr(model, "load_state_dict", load_state_dict)
    return captured


@pytest.mark.parametrize("norm", [False, True])
def test_load_model_weights_reads_into_the_parameters_unless_a_module_loads_its_own_way(
    tmp_path, monkeypatch, norm
):
    """A plain model's tensors are the ones load_state_dict receives (filled by the read, no second copy);
    a model with a BatchNorm (its own _load_from_state_dict) receives new tensors, and both load exactly."""
    from lockstep.checkpoint.model_files import load_model_weights, save_model_files

    def build(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        layers = (
            [torch.nn.Linear(16, 8)] + ([torch.nn.BatchNorm1d(8)] if norm else []) + [torch.nn.Linear(8, 2)]
        )
        return torch.nn.Sequential(*layers)

    save_model_files(build(0).state_dict(), tmp_path / "model")
    model = build(1)
    captured = _captured_load(model, monkeypatch)
    load_model_weights(model, tmp_path / "model")
    state = model.state_dict()
    for name, tensor in build(0).state_dict().items():
        assert torch.equal(state[name], tensor), name
        assert (captured[name].data_ptr() == state[name].data_ptr()) is (not norm), name


def test_a_key_mismatch_leaves_the_model_untouched(tmp_path):
    from lockstep.checkpoint.model_files import load_model_weights, save_model_files

    save_model_files({"0.weight": torch.ones(8, 16), "0.bias": torch.ones(8)}, tmp_path / "model")
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 2))
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"Missing from the files \(2\): \['1.weight', '1.bias'\]"):
        load_model_weights(model, tmp_path / "model")
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_a_dtype_the_one_pass_reader_does_not_know_is_read_by_the_safetensors_library(tmp_path, monkeypatch):
    from lockstep.checkpoint.model_files import load_model_weights, save_model_files

    torch.manual_seed(0)
    saved = torch.nn.Linear(6, 3)
    save_model_files(saved.state_dict(), tmp_path / "model")
    monkeypatch.delitem(single_pass.SAFETENSORS_DTYPES, "F32")
    with pytest.raises(single_pass.NotReadableInOnePass, match="'F32'"):
        single_pass.read_safetensors(tmp_path / "model" / "model.safetensors", {})
    model = torch.nn.Linear(6, 3)
    load_model_weights(model, tmp_path / "model")
    for name, tensor in saved.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
