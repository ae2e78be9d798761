"""When ``save_state`` returns, the checkpoint folder is final (issue 43, item 4).

Every file, the manifest, ``latest`` and the rotation of older checkpoints are in place on every rank at
return; only durability (fsync) continues on a thread, changing nothing a user can see. The manifest's
checksums are those of the bytes the save wrote, so a file torn after the return is caught when loading,
and an automatic ``load_state()`` that meets a file it cannot read falls back to the previous checkpoint.

"The seal slowed down" below is a slow disk: ``os.fsync`` takes a quarter of a second per call.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import threading
from pathlib import Path

import pytest
import torch

from lockstep import Accelerator, ProjectConfiguration
from lockstep.checkpoint import layout
from tests.helpers.multiprocess import run_distributed

SLOW_FSYNC_SECONDS = 0.25


def _slow_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow disk: every fsync takes SLOW_FSYNC_SECONDS (the durability thread's work; the training
    thread fsyncs nothing)."""
    real = os.fsync

    def slow(fd: int) -> None:
        threading.Event().wait(SLOW_FSYNC_SECONDS)
        real(fd)

    monkeypatch.setattr(os, "fsync", slow)


class _LinearModel(torch.nn.Module):
    """y = a * x + b, with two scalar parameters (the model of Accelerate's checkpoint tests)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(1))
        self.b = torch.nn.Parameter(torch.randn(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.a + self.b


@pytest.mark.parametrize("safe_serialization", [True, False], ids=["safetensors", "pickle"])
def test_eleven_saves_keeping_two_leave_a_folder_that_can_be_removed_at_once(safe_serialization):
    """Accelerate 1.15's ``test_checkpoint_deletion`` (tests/test_state_checkpointing.py), against lockstep:
    eleven automatically named saves of a model alone with ``total_limit=2``, then the temporary folder is
    removed as the ``with`` block ends. With the rotation on a thread it failed on both serialisations:
    ``OSError: [Errno 39] Directory not empty: 'checkpoints'``."""
    with tempfile.TemporaryDirectory() as folder:
        random.seed(42)
        torch.manual_seed(42)
        project = ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=2)
        accelerator = Accelerator(project_dir=folder, project_config=project)
        accelerator.prepare(_LinearModel())
        for _ in range(11):
            accelerator.save_state(safe_serialization=safe_serialization)
        root = Path(folder) / "checkpoints"
        assert not (root / "checkpoint_0").exists()
        assert (root / "checkpoint_9").is_dir() and (root / "checkpoint_10").is_dir()
        assert sorted(os.listdir(root)) == ["checkpoint_10", "checkpoint_9", "latest"]
    assert not Path(folder).exists()


def _training(
    project_dir: Path, total_limit: int | None = None
) -> tuple[Accelerator, torch.nn.Module, torch.optim.Optimizer]:
    project = ProjectConfiguration(
        project_dir=project_dir, automatic_checkpoint_naming=True, total_limit=total_limit
    )
    accelerator = Accelerator(project_config=project)
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    _step(accelerator, model, optimizer)
    return accelerator, model, optimizer


def _step(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    accelerator.backward(model(torch.ones(3, 32)).square().sum())
    optimizer.step()
    optimizer.zero_grad()


def test_listed_copied_and_deleted_at_return_with_the_seal_slowed_down(tmp_path, monkeypatch):
    """At return the folder is what it will stay: the checkpoints kept, their manifests and ``latest``;
    a copy taken then verifies; the project folder can be deleted at once, and the durability still running
    neither fails nor brings anything back."""
    _slow_fsync(monkeypatch)
    project = tmp_path / "run"
    accelerator, _, _ = _training(project, total_limit=2)
    for _ in range(3):
        newest = Path(accelerator.save_state())
    root = project / "checkpoints"
    assert sorted(os.listdir(root)) == ["checkpoint_1", "checkpoint_2", "latest"]
    assert (root / "latest").read_text() == "checkpoint_2\n"
    files = set(layout.verify(newest).files)  # checksums too
    assert {"model.safetensors", "optimizer.bin", "random_states_0.pkl", "accelerator_state.json"} <= files
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    assert sorted(os.listdir(copy)) == ["checkpoint_1", "checkpoint_2", "latest"]
    assert set(layout.verify(copy / "checkpoint_2").files) == files
    assert layout.newest_valid_checkpoint(copy) == copy / "checkpoint_2"
    shutil.rmtree(project)
    accelerator.end_training()  # waits for the durability: no error, nothing recreated
    assert not project.exists()


def test_a_file_torn_right_after_return_is_caught_and_the_previous_checkpoint_loads(tmp_path, monkeypatch):
    """The issue's case: ``optimizer.bin`` truncated to half right after ``save_state`` returns, with the
    seal slowed down. Sealed from the disk, the manifest certified the torn bytes and ``load_state()`` died
    in ``torch.load`` with ``OSError: [Errno 22] Invalid argument``; from the bytes written, the size is
    wrong and ``load_state()`` takes checkpoint_0, naming the file."""
    _slow_fsync(monkeypatch)
    accelerator, model, optimizer = _training(tmp_path)
    accelerator.save_state()
    weights, momentum = model.weight.detach().clone(), _momentum(optimizer)
    _step(accelerator, model, optimizer)
    torn = Path(accelerator.save_state()) / "optimizer.bin"
    size = torn.stat().st_size
    with open(torn, "r+b") as handle:
        handle.truncate(size // 2)
    with pytest.warns(
        UserWarning,
        match=rf"Skipped 1 newer checkpoint.*checkpoint_1: optimizer.bin has {size // 2} bytes but the "
        rf"manifest says {size} \(truncated\?\)",
    ):
        accelerator.load_state()
    assert torch.equal(model.weight, weights) and torch.equal(_momentum(optimizer), momentum)
    assert accelerator.project_configuration.iteration == 1


def _momentum(optimizer: torch.optim.Optimizer) -> torch.Tensor:
    return next(iter(optimizer.state.values()))["momentum_buffer"].clone()


def test_an_unreadable_file_that_verifies_falls_back_naming_it(tmp_path):
    """A checkpoint whose manifest certifies a torn file (as the seal of the previous release could write):
    the checksums verify, reading fails; ``load_state()`` warns naming the file and loads checkpoint_0."""
    accelerator, model, optimizer = _training(tmp_path)
    accelerator.save_state()
    weights, momentum = model.weight.detach().clone(), _momentum(optimizer)
    _step(accelerator, model, optimizer)
    folder = Path(accelerator.save_state())
    accelerator.wait_for_checkpoint()
    _tear_and_certify(folder, "optimizer.bin")
    with pytest.warns(
        UserWarning,
        match=r"Skipped 1 newer checkpoint.*checkpoint_1: optimizer.bin cannot be read \(RuntimeError: ",
    ):
        accelerator.load_state()
    assert torch.equal(model.weight, weights) and torch.equal(_momentum(optimizer), momentum)
    assert accelerator.project_configuration.iteration == 1


def _tear_and_certify(folder: Path, name: str) -> None:
    """Truncate ``folder/name`` to half and rewrite the manifest from the disk, certifying it."""
    manifest = layout.read_manifest(folder)
    path = folder / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    (folder / layout.MANIFEST_NAME).unlink()
    layout.write_manifest(folder, world_size=manifest.world_size, step=manifest.step)


def _save_then_look(project_dir: str) -> dict:
    accelerator, _, _ = _training(Path(project_dir), total_limit=1)
    if accelerator.is_main_process:  # the main process makes the checkpoint durable: a slow disk there
        real = os.fsync
        os.fsync = lambda fd: (threading.Event().wait(SLOW_FSYNC_SECONDS), real(fd))[1]  # forked process only
    accelerator.save_state()
    folder = Path(accelerator.save_state())
    root = folder.parent
    at_return = {
        "listing": sorted(os.listdir(root)),
        "latest": (root / "latest").read_text(),
        "files": sorted(layout.verify(folder).files),
    }
    accelerator.end_training()
    return at_return


def test_every_rank_finds_the_final_folder_when_save_state_returns(tmp_path):
    """Two processes: both find the manifest (with both ranks' files), ``latest`` and the rotation done
    when ``save_state`` returns; before, rank 1 found them only after ``wait_for_everyone``."""
    for result in run_distributed(_save_then_look, 2, str(tmp_path), timeout=90):
        assert result["listing"] == ["checkpoint_1", "latest"], result
        assert result["latest"] == "checkpoint_1\n"
        assert {"random_states_0.pkl", "random_states_1.pkl", "model.safetensors"} <= set(result["files"])


def _rank_1_file_unreadable(project_dir: str) -> dict:
    accelerator, wrapped, _ = _training(Path(project_dir))
    model = accelerator.unwrap_model(wrapped)
    accelerator.save_state()
    weights = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    folder = Path(accelerator.save_state())
    accelerator.wait_for_checkpoint()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        _tear_and_certify(folder, "random_states_1.pkl")
    accelerator.wait_for_everyone()
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator.load_state()
    return {
        "fell_back": torch.equal(model.weight, weights),
        "loaded_from": str(accelerator._saving.manager.loaded_from),
        "warnings": [str(w.message) for w in caught],
    }


def test_two_processes_fall_back_together_when_one_rank_cannot_read_its_file(tmp_path):
    """Rank 1's ``random_states_1.pkl`` is unreadable (its checksum verifies): both ranks load checkpoint_0;
    the main process warns, naming rank 1's file."""
    results = run_distributed(_rank_1_file_unreadable, 2, str(tmp_path), timeout=90)
    for result in results:
        assert result["fell_back"] and result["loaded_from"].endswith("checkpoint_0"), result
    assert any("random_states_1.pkl cannot be read" in text for text in results[0]["warnings"]), results[0]
