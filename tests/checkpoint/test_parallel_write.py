"""A large checkpoint's files are written on several threads; an error in one is raised once all are done."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lockstep.checkpoint import hashed_write, training_state
from lockstep.checkpoint.training_state import Snapshot, write_snapshot


def _snapshot() -> Snapshot:
    snap = Snapshot()
    snap.models.append((Path("."), {"weight": torch.arange(6.0).view(2, 3)}))
    snap.torch_files.append(("optimizer.bin", {"state": {0: {"momentum": torch.ones(4)}}}))
    snap.safetensors_files.append(("grads_0.safetensors", {"weight": torch.full((2, 3), 2.0)}))
    snap.json_files.append(("accelerator_state.json", {"step": 3}))
    return snap


def test_a_large_snapshot_writes_its_files_on_several_threads(tmp_path, monkeypatch):
    monkeypatch.setattr(training_state, "PARALLEL_WRITE_BYTES", 0)
    writers: set[str] = set()
    real = torch.save

    def recorded(*args, **kwargs):
        writers.add(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "save", recorded)
    write_snapshot(_snapshot(), tmp_path)
    assert writers and all(name.startswith("lockstep-save") for name in writers)
    assert torch.equal(load_file(tmp_path / "model.safetensors")["weight"], torch.arange(6.0).view(2, 3))
    assert torch.equal(torch.load(tmp_path / "optimizer.bin")["state"][0]["momentum"], torch.ones(4))
    assert (tmp_path / "accelerator_state.json").read_text() == '{\n "step": 3\n}'


def test_a_small_snapshot_writes_in_order_on_the_calling_thread(tmp_path, monkeypatch):
    writers: list[str] = []
    real = torch.save
    monkeypatch.setattr(
        torch, "save", lambda *a, **k: (writers.append(threading.current_thread().name), real(*a, **k))
    )
    write_snapshot(_snapshot(), tmp_path)
    assert writers == [threading.current_thread().name]


def test_a_failed_write_is_raised_after_every_other_write_has_finished(tmp_path, monkeypatch):
    monkeypatch.setattr(training_state, "PARALLEL_WRITE_BYTES", 0)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    real = hashed_write.write_safetensors

    def slow_write_safetensors(*args, **kwargs):
        time.sleep(0.3)  # still writing when the other write fails
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    monkeypatch.setattr(hashed_write, "write_safetensors", slow_write_safetensors)
    with pytest.raises(OSError, match="No space left on device"):
        write_snapshot(_snapshot(), tmp_path)
    assert (tmp_path / "grads_0.safetensors").is_file()  # finished before the error was raised
