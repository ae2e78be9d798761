"""Checkpoint files are checksummed from the bytes the save wrote, not from a read of the disk afterwards
(issue 43, item 4): the writers, and the manifest of every kind of save."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import load_file

from lockstep import Accelerator
from lockstep.checkpoint import layout
from lockstep.checkpoint.hashed_write import write_safetensors, write_torch
from lockstep.checkpoint.single_pass import read_safetensors


def _facts_of(path: Path) -> dict:
    data = path.read_bytes()
    return {"size": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()}


def test_a_safetensors_file_written_and_hashed_in_one_pass_reads_back_everywhere(tmp_path):
    """The file that ``write_safetensors`` writes is a safetensors file: the library and the one-pass reader
    read every dtype and shape back (empty and 0-d tensors, bf16, bool), with the metadata; the entry it
    returns is the file's."""
    torch.manual_seed(0)
    tensors = {
        "weight": torch.randn(3, 5),
        "half": torch.randn(7).to(torch.bfloat16),
        "mask": torch.tensor([True, False, True]),
        "count": torch.tensor(41, dtype=torch.int64),
        "empty": torch.empty(0, 4),
        "bytes": torch.arange(5, dtype=torch.uint8),
    }
    path = tmp_path / "model.safetensors"
    facts = write_safetensors(tensors, path, {"format": "pt", "note": "x"})
    assert facts == _facts_of(path)
    loaded = load_file(str(path))
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in tensors.items())
    with safe_open(path, framework="pt") as handle:
        assert handle.metadata() == {"format": "pt", "note": "x"}
    again, metadata = read_safetensors(path, {})
    assert all(torch.equal(again[name], tensor) for name, tensor in tensors.items())
    assert metadata == {"format": "pt", "note": "x"}
    header_length = int.from_bytes(path.read_bytes()[:8], "little")  # padded to 8 bytes, as the format's
    assert header_length % 8 == 0 and json.loads(path.read_bytes()[8 : 8 + header_length])["count"] == {
        "dtype": "I64",
        "shape": [],
        "data_offsets": [15 * 4 + 7 * 2 + 3, 15 * 4 + 7 * 2 + 3 + 8],
    }


def test_a_torch_file_written_through_the_hashing_file_loads_and_its_entry_is_the_files(tmp_path):
    state = {
        "state": {0: {"momentum_buffer": torch.randn(64, 64)}},
        "param_groups": [{"lr": 0.1, "params": [0]}],
    }
    path = tmp_path / "optimizer.bin"
    facts = write_torch(state, path)
    assert facts == _facts_of(path) and facts["size"] > 64 * 64 * 4
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["state"][0]["momentum_buffer"], state["state"][0]["momentum_buffer"])
    assert loaded["param_groups"] == state["param_groups"]


def test_the_manifest_records_what_was_written_not_what_is_on_the_disk_now(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"torn")
    (tmp_path / "hook.txt").write_bytes(b"written by a save hook")
    written = {"size": 12, "xxh3_128": xxhash.xxh3_128(b"twelve bytes").hexdigest()}
    manifest = layout.write_manifest(tmp_path, world_size=1, step=3, known={"a.bin": written}, fsync=False)
    assert manifest.files == {"a.bin": written, "hook.txt": _facts_of(tmp_path / "hook.txt")}
    with pytest.raises(
        layout.CheckpointError, match=r"a.bin has 4 bytes but the manifest says 12 \(truncated\?\)"
    ):
        layout.verify(tmp_path)


def _torn_before_the_manifest(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Truncate ``name`` to half in the folder being committed, just before its manifest is written."""
    real = layout.write_manifest

    def tearing(folder: Path, **kwargs):
        path = Path(folder) / name
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        return real(folder, **kwargs)

    monkeypatch.setattr(layout, "write_manifest", tearing)


@pytest.mark.parametrize(
    "how",
    [{"durable": "background"}, {"durable": "sync"}, {"async_save": True}],
    ids=["background", "sync", "async_save"],
)
def test_every_kind_of_save_certifies_the_bytes_it_wrote(tmp_path, monkeypatch, how):
    """A file torn between its write and the manifest: every kind of save records its written size and
    checksum (the asynchronous one through the ranks' markers), so the checkpoint is refused by name."""
    accelerator = Accelerator()
    model = torch.nn.Linear(16, 8)
    model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    _torn_before_the_manifest(monkeypatch, "model.safetensors")
    folder = Path(accelerator.save_state(str(tmp_path / "ckpt"), **how))
    accelerator.wait_for_checkpoint()
    recorded = layout.read_manifest(folder).files["model.safetensors"]["size"]
    with pytest.raises(
        layout.CheckpointError,
        match=rf"model.safetensors has {recorded // 2} bytes but the manifest says {recorded} \(truncated\?\)",
    ):
        accelerator.load_state(str(folder))
