"""Model weight files: sharding, index format, tied weights, atomic writes, safe loading."""

import json
import os
import pickle
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

import lockstep.checkpoint.model_files as model_files
from lockstep.checkpoint.model_files import (
    UnsafeCheckpointError,
    load_model_files,
    load_model_weights,
    parse_size,
    save_model_files,
)


class _Net(nn.Module):
    """fp32 and bf16 parameters, an int64 buffer, and optionally an lm_head tied to the embedding."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4).to(torch.bfloat16)
        self.lm_head = nn.Linear(4, 10, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("steps", torch.arange(5, dtype=torch.int64) * 7)


def _sized_state_dict() -> dict[str, torch.Tensor]:
    """fp32 tensors of 400, 400, 400, 2000 and 400 bytes."""
    sizes = {"a": 100, "b": 100, "c": 100, "big": 500, "e": 100}
    return {name: torch.arange(n, dtype=torch.float32) + i for i, (name, n) in enumerate(sizes.items())}


def _assert_equal(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(loaded) == sorted(expected)
    for key, tensor in expected.items():
        assert loaded[key].dtype == tensor.dtype, key
        assert torch.equal(loaded[key], tensor), key


def _files(directory: Path) -> list[str]:
    return sorted(entry.name for entry in directory.iterdir())


# -- parse_size -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        ("10GB", 10 * 10**9),
        ("500MB", 500 * 10**6),
        ("1.5GiB", 1_610_612_736),
        ("2000KB", 2_000_000),
        (12345, 12345),
        ("12345", 12345),
        ("0.3GB", 300_000_000),
        (" 2 MiB ", 2_097_152),
        ("1kib", 1024),
        ("3TB", 3 * 10**12),
        ("5Gb", 625_000_000),  # transformers: a lowercase b means bits
    ],
)
def test_parse_size(size, expected):
    assert parse_size(size) == expected


@pytest.mark.parametrize("size", ["ten GB", "10XB", "", "-5GB", "GB", "1e3MB"])
def test_parse_size_rejects_unreadable_strings(size):
    with pytest.raises(ValueError, match=re.escape(f"parse_size({size!r}) is not a size lockstep can read")):
        parse_size(size)


def test_parse_size_errors_give_examples_and_reject_non_positive_and_wrong_types():
    with pytest.raises(ValueError, match=r"'10GB', '500MB', '1\.5GiB' or '2000KB'"):
        parse_size("lots")
    with pytest.raises(
        ValueError, match=re.escape("parse_size('0MB') is invalid: it must be at least 1 byte")
    ):
        parse_size("0MB")
    with pytest.raises(ValueError, match=re.escape("parse_size(0) is invalid")):
        parse_size(0)
    with pytest.raises(TypeError, match=re.escape("parse_size(True) is a bool, not an int or a str")):
        parse_size(True)
    with pytest.raises(TypeError, match=re.escape("parse_size(1.5) is a float")):
        parse_size(1.5)
    with pytest.raises(ValueError, match=re.escape("save_model_files(max_shard_size=...)('big')")):
        save_model_files({}, "unused", max_shard_size="big")


# -- round trips ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("safe_serialization", [True, False])
def test_round_trip_is_exact_for_several_dtypes(tmp_path, safe_serialization):
    torch.manual_seed(0)
    state_dict = _Net().state_dict()
    assert {t.dtype for t in state_dict.values()} == {torch.float32, torch.bfloat16, torch.int64}

    written = save_model_files(state_dict, tmp_path / "out", safe_serialization=safe_serialization)

    name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    assert written == [tmp_path / "out" / name]
    assert _files(tmp_path / "out") == [name]
    _assert_equal(load_model_files(tmp_path / "out"), state_dict)
    _assert_equal(load_model_files(written[0], device=torch.device("cpu")), state_dict)  # a file works too

    fresh = _Net()
    load_model_weights(fresh, tmp_path / "out")
    _assert_equal(fresh.state_dict(), state_dict)


def test_safetensors_metadata_has_format_pt_and_user_entries(tmp_path):
    save_model_files({"w": torch.ones(2)}, tmp_path, metadata={"step": "12"})
    with safe_open(tmp_path / "model.safetensors", framework="pt") as handle:
        assert handle.metadata() == {"format": "pt", "step": "12"}


def test_metadata_errors_and_warning(tmp_path):
    with pytest.raises(TypeError, match=re.escape("save_model_files(metadata={'step': 12}) is invalid")):
        save_model_files({"w": torch.ones(2)}, tmp_path, metadata={"step": 12})
    with pytest.raises(ValueError, match="uses the key 'lockstep_tied', which lockstep reserves"):
        save_model_files({"w": torch.ones(2)}, tmp_path, metadata={"lockstep_tied": "{}"})
    with pytest.warns(UserWarning, match=r"metadata=\.\.\.\) is ignored with safe_serialization=False"):
        save_model_files({"w": torch.ones(2)}, tmp_path, metadata={"a": "b"}, safe_serialization=False)
    with pytest.raises(TypeError, match="maps 'w' to a list; it must map str keys to torch.Tensor values"):
        save_model_files({"w": [1.0]}, tmp_path)
    with pytest.raises(ValueError, match=r"\['w'\] is on the meta device"):
        save_model_files({"w": torch.empty(2, device="meta")}, tmp_path)


def test_views_are_stored_as_copies_of_their_own_data(tmp_path):
    fused = torch.arange(12, dtype=torch.float32)
    state_dict = {
        "q": fused[:4],
        "k": fused[4:],
        "flat": fused,
        "grid": fused.view(3, 4),
        "t": fused.view(3, 4).t(),
        "empty": torch.empty(0, 3),
    }
    for safe in (True, False):
        save_model_files(state_dict, tmp_path / str(safe), safe_serialization=safe)
        loaded = load_model_files(tmp_path / str(safe))
        _assert_equal(loaded, state_dict)
        assert loaded["t"].is_contiguous()
        assert loaded["q"].untyped_storage().nbytes() == 16  # the slice alone, not the fused storage
    assert fused.tolist() == [float(i) for i in range(12)]  # the caller's tensors are untouched


# -- sharding -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("safe_serialization", [True, False])
def test_sharding_names_index_and_sizes(tmp_path, safe_serialization):
    state_dict = _sized_state_dict()
    written = save_model_files(
        state_dict, tmp_path, max_shard_size=800, safe_serialization=safe_serialization
    )

    prefix, ext = ("model", "safetensors") if safe_serialization else ("pytorch_model", "bin")
    shards = [f"{prefix}-0000{i}-of-00004.{ext}" for i in range(1, 5)]
    assert [p.name for p in written] == [*shards, f"{prefix}.{ext}.index.json"]
    assert _files(tmp_path) == sorted(p.name for p in written)
    index = json.loads((tmp_path / f"{prefix}.{ext}.index.json").read_text())
    assert index == {
        "metadata": {"total_size": 3600},
        "weight_map": {"a": shards[0], "b": shards[0], "c": shards[1], "big": shards[2], "e": shards[3]},
    }
    for shard in shards:
        tensors = load_model_files(tmp_path / shard)
        shard_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        assert shard_bytes <= 800 or list(tensors) == ["big"], shard
    _assert_equal(load_model_files(tmp_path), state_dict)


def test_max_shard_size_string_and_default(tmp_path):
    written = save_model_files(_sized_state_dict(), tmp_path / "kb", max_shard_size="1KB")
    index = json.loads((tmp_path / "kb" / "model.safetensors.index.json").read_text())
    assert len(written) == 5  # [a, b], [c], [big], [e] + the index: a + b + c = 1200 > 1000 bytes
    assert sorted(set(index["weight_map"].values())) == [p.name for p in written[:4]]
    assert [p.name for p in save_model_files(_sized_state_dict(), tmp_path / "default")] == [
        "model.safetensors"
    ]


def test_resave_with_fewer_shards_removes_stale_files(tmp_path):
    (tmp_path / "README.md").write_text("keep me")
    (tmp_path / "model-notes.json").write_text("{}")
    save_model_files(_sized_state_dict(), tmp_path, max_shard_size=800, safe_serialization=False)
    save_model_files(_sized_state_dict(), tmp_path, max_shard_size=800)
    assert len(_files(tmp_path)) == 7  # 5 safetensors files + 2 unrelated; the .bin save is gone

    save_model_files(_sized_state_dict(), tmp_path, max_shard_size=1200)

    assert _files(tmp_path) == [
        "README.md",
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        "model-notes.json",
        "model.safetensors.index.json",
    ]
    save_model_files(_sized_state_dict(), tmp_path)
    assert _files(tmp_path) == ["README.md", "model-notes.json", "model.safetensors"]
    _assert_equal(load_model_files(tmp_path), _sized_state_dict())


def test_failed_write_leaves_previous_file_and_no_temporary(tmp_path, monkeypatch):
    save_model_files({"w": torch.ones(3)}, tmp_path)

    def broken_save_file(tensors, path, metadata=None):
        Path(path).write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(model_files, "save_file", broken_save_file)
    with pytest.raises(OSError, match="disk full"):
        save_model_files({"w": torch.zeros(3)}, tmp_path)

    assert _files(tmp_path) == ["model.safetensors"]
    assert torch.equal(load_model_files(tmp_path)["w"], torch.ones(3))


@pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX")
def test_written_files_follow_the_umask(tmp_path):
    umask = os.umask(0o022)
    try:
        save_model_files(_sized_state_dict(), tmp_path, max_shard_size=800)
    finally:
        os.umask(umask)
    assert {entry.stat().st_mode & 0o777 for entry in tmp_path.iterdir()} == {0o644}


# -- tied weights ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("safe_serialization", [True, False])
@pytest.mark.parametrize("max_shard_size", ["10GB", 100])
def test_tied_weights_round_trip_sharing_storage(tmp_path, safe_serialization, max_shard_size):
    torch.manual_seed(0)
    model = _Net(tied=True)
    state_dict = model.state_dict()
    assert state_dict["lm_head.weight"].data_ptr() == state_dict["embed.weight"].data_ptr()

    save_model_files(
        state_dict, tmp_path, max_shard_size=max_shard_size, safe_serialization=safe_serialization
    )
    loaded = load_model_files(tmp_path)

    _assert_equal(loaded, state_dict)
    assert loaded["lm_head.weight"].data_ptr() == loaded["embed.weight"].data_ptr()
    fresh = _Net(tied=True)
    load_model_weights(fresh, tmp_path)
    assert fresh.lm_head.weight is fresh.embed.weight
    assert torch.equal(fresh.lm_head.weight, model.embed.weight)


def test_tied_weights_are_stored_once_and_recorded(tmp_path):
    state_dict = _Net(tied=True).state_dict()
    save_model_files(state_dict, tmp_path / "one")
    with safe_open(tmp_path / "one" / "model.safetensors", framework="pt") as handle:
        assert "lm_head.weight" not in handle.keys()
        assert json.loads(handle.metadata()["lockstep_tied"]) == {"lm_head.weight": "embed.weight"}

    # embed 160 B, proj 32 + 8 B, steps 40 B: embed is alone in shard 1, its alias goes with it
    save_model_files(state_dict, tmp_path / "many", max_shard_size=100)
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_size": 240, "lockstep_tied": {"lm_head.weight": "embed.weight"}}
    assert index["weight_map"]["lm_head.weight"] == index["weight_map"]["embed.weight"]
    assert sorted(index["weight_map"]) == sorted(state_dict)


# -- errors when loading --------------------------------------------------------------------------------


class _Payload:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        command = f"\"{sys.executable}\" -c \"open(r'{self.marker}', 'w').close()\""
        return (os.system, (command,))


@pytest.mark.parametrize("writer", ["torch.save", "pickle.dump"])
def test_malicious_bin_is_refused_without_running_it(tmp_path, writer):
    marker = tmp_path / "pwned"
    path = tmp_path / "pytorch_model.bin"
    payload = {"w": torch.ones(2), "evil": _Payload(marker)}
    if writer == "torch.save":
        torch.save(payload, path)
    else:
        path.write_bytes(pickle.dumps(payload, protocol=2))

    with pytest.raises(UnsafeCheckpointError, match=re.escape(str(path))):
        load_model_files(tmp_path)
    assert not marker.exists()

    pickle.loads(pickle.dumps(_Payload(marker), protocol=2))  # the payload is live: unpickling runs it
    assert marker.exists()
    assert issubclass(UnsafeCheckpointError, ValueError)


def test_missing_shard_is_named(tmp_path):
    save_model_files(_sized_state_dict(), tmp_path, max_shard_size=800)
    (tmp_path / "model-00002-of-00004.safetensors").unlink()
    expected = (
        f"{tmp_path / 'model.safetensors.index.json'} names 4 shard files but 1 are missing: "
        "model-00002-of-00004.safetensors. The folder contains model-00001-of-00004.safetensors, "
        "model-00003-of-00004.safetensors, model-00004-of-00004.safetensors, model.safetensors.index.json."
    )
    with pytest.raises(FileNotFoundError, match=re.escape(expected)):
        load_model_files(tmp_path)


def test_missing_and_empty_folders(tmp_path):
    with pytest.raises(
        FileNotFoundError, match=re.escape(f"load_model_files({str(tmp_path / 'nope')!r}): no such")
    ):
        load_model_files(tmp_path / "nope")
    with pytest.raises(
        FileNotFoundError, match=r"holds no model weights \(looked for .*\); it contains nothing\."
    ):
        load_model_files(tmp_path)
    (tmp_path / "optimizer.bin").write_bytes(b"")
    with pytest.raises(
        FileNotFoundError,
        match=r"model\.safetensors\.index\.json, model\.safetensors, .*"
        r"pytorch_model\.bin\); it contains optimizer\.bin\.",
    ):
        load_model_files(tmp_path)


def test_corrupt_files_raise_value_errors_naming_them(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(
        ValueError, match=re.escape(f"{tmp_path / 'model.safetensors'} is not a valid safetensors")
    ):
        load_model_files(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(
        ValueError, match=r"model\.safetensors\.index\.json is not a valid weight index \(KeyError"
    ):
        load_model_files(tmp_path)
    (tmp_path / "model.safetensors.index.json").unlink()
    (tmp_path / "model.safetensors").unlink()
    torch.save([torch.ones(1)], tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin holds a list, not a dict of tensors"):
        load_model_files(tmp_path)


def test_load_model_weights_lists_missing_and_unexpected_keys(tmp_path):
    save_model_files({"embed.weight": torch.zeros(10, 4), "extra": torch.ones(1)}, tmp_path)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "the files do not match the model. Missing from the files (4): "
            "['steps', 'proj.weight', 'proj.bias', 'lm_head.weight']. Unknown to the model (1): ['extra']."
        ),
    ):
        load_model_weights(_Net(tied=True), tmp_path)

    model = _Net(tied=True)
    model.steps.zero_()
    save_model_files({"embed.weight": torch.zeros(10, 4), "steps": torch.arange(5)}, tmp_path)
    load_model_weights(model, tmp_path, strict=False)
    assert torch.equal(model.lm_head.weight, torch.zeros(10, 4))
    assert model.steps.tolist() == [0, 1, 2, 3, 4]
