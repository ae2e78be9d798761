"""``save_state(durable="background")``, the default: the call returns on every rank with the checkpoint
folder final (files, manifest, ``latest``, rotation); only the fsync runs on a thread, changing nothing
visible; a failed fsync reaches the training loop at the next ``should_stop`` (or ``save_state``) on every
rank. (Issue 43 item 4; before, the manifest, ``latest`` and rotation ran on the thread too.)"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from lockstep import Accelerator, ProjectConfiguration
from lockstep.checkpoint import CheckpointError, layout, load_model_files
from tests.helpers.cli import REPO, SCRIPTS, cli_env
from tests.helpers.multiprocess import run_distributed


def _training(project_dir: Path, total_limit: int | None = None) -> tuple[Accelerator, torch.nn.Module]:
    project = ProjectConfiguration(
        project_dir=project_dir, automatic_checkpoint_naming=True, total_limit=total_limit
    )
    accelerator = Accelerator(project_config=project)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.backward(model(torch.ones(3, 8)).sum())
    optimizer.step()
    return accelerator, model


def _gate_the_background_fsync(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, list[str]]:
    """fsync off the training thread waits until the returned event is set; the list gets the name of
    every file or folder fsynced there."""
    release, real, fsynced = threading.Event(), os.fsync, []

    def gated(fd: int) -> None:
        if threading.current_thread() is not threading.main_thread():
            assert release.wait(30)
            fsynced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)

    monkeypatch.setattr(os, "fsync", gated)
    return release, fsynced


def _full_disk_at_the_manifest(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _input_output_error_on_the_thread(fd: int) -> None:
    if threading.current_thread() is not threading.main_thread():
        raise OSError(errno.EIO, os.strerror(errno.EIO))


def _checks_until_raised(accelerator: Accelerator) -> list[str]:
    """The training loop's ``should_stop`` checks (every rank the same number) until one raises."""
    for _ in range(250):
        try:
            assert accelerator.should_stop is False
        except CheckpointError as error:
            return [str(error)]
        threading.Event().wait(0.02)
    return []


def test_the_call_returns_with_the_folder_final_while_its_fsync_still_waits(tmp_path, monkeypatch):
    """Manifest, ``latest`` and rotation are done at return with the fsync held back; ``wait_for_everyone``
    does not wait for the fsync (nothing visible is left); ``wait_for_checkpoint`` does."""
    accelerator, _ = _training(tmp_path, total_limit=2)
    accelerator.save_state()
    accelerator.save_state()
    accelerator.wait_for_checkpoint()
    release, fsynced = _gate_the_background_fsync(monkeypatch)
    folder = Path(accelerator.save_state(durable="background"))
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint_1", "checkpoint_2", "latest"]
    assert (root / "latest").read_text() == "checkpoint_2\n"
    assert layout.newest_valid_checkpoint(root) == folder
    files = set(layout.verify(folder).files)
    assert {"model.safetensors", "optimizer.bin", "random_states_0.pkl"} <= files
    accelerator.wait_for_everyone()
    assert accelerator._saving.manager.writer.busy and fsynced == []
    release.set()
    accelerator.wait_for_checkpoint()
    assert files | {layout.MANIFEST_NAME, "checkpoint_2", "checkpoints"} <= set(fsynced)


def test_a_full_disk_at_the_manifest_fails_the_save_itself_and_loses_nothing(tmp_path, monkeypatch):
    accelerator, model = _training(tmp_path)
    accelerator.save_state()
    saved = model.weight.detach().clone()
    monkeypatch.setattr(layout, "write_manifest", _full_disk_at_the_manifest)
    with pytest.raises(
        CheckpointError,
        match=rf"^Saving the checkpoint {tmp_path}/checkpoints/checkpoint_1 ran out of disk space \(OSError: "
        r"\[Errno 28\] No space left on device\)",
    ):
        accelerator.save_state(durable="background")
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint_0", "latest"]
    with torch.no_grad():
        model.weight.zero_()
    accelerator.load_state()
    assert torch.equal(model.weight.detach(), saved)


def test_a_failed_fsync_is_raised_at_the_next_should_stop_and_the_checkpoint_stays(tmp_path, monkeypatch):
    accelerator, _ = _training(tmp_path)
    monkeypatch.setattr(os, "fsync", _input_output_error_on_the_thread)
    folder = Path(accelerator.save_state(durable="background"))
    errors = _checks_until_raised(accelerator)
    assert errors == [
        f"The previous asynchronous checkpoint save failed: Checkpoint {folder} is in place and loads, but "
        "making it durable failed ([Errno 5] Input/output error): a power loss may lose it. Check that disk "
        "before relying on this checkpoint."
    ]
    assert accelerator.should_stop is False  # raised once
    assert layout.newest_valid_checkpoint(tmp_path / "checkpoints") == folder  # nothing visible changed


def test_durable_names_its_choices():
    accelerator = Accelerator()
    with pytest.raises(
        ValueError, match=r"save_state\(durable='fast'\) is invalid: it must be one of 'sync', "
    ):
        accelerator.save_state("unused", durable="fast")


def _fsync_fails_on_the_main_process(folder: str) -> list[str]:
    accelerator, _ = _training(Path(folder))
    if accelerator.is_main_process:
        os.fsync = _input_output_error_on_the_thread  # this forked process only
    accelerator.save_state(durable="background")
    errors = _checks_until_raised(accelerator)
    accelerator.save_state(durable="background")  # fails again: load_state raises it on every rank
    try:
        accelerator.load_state()
    except CheckpointError as error:
        errors.append(str(error))
    return errors


def test_two_processes_both_raise_a_failed_fsync_at_the_same_should_stop(tmp_path):
    results = run_distributed(_fsync_fails_on_the_main_process, 2, str(tmp_path), timeout=60)
    folder = f"{tmp_path}/checkpoints/checkpoint_0"
    assert results[0][0].startswith(
        f"The previous asynchronous checkpoint save failed: Checkpoint {folder} is in place and loads, but "
        "making it durable failed ([Errno 5] Input/output error)"
    )
    assert results[1][0].startswith(
        "The previous asynchronous checkpoint save failed on 1 of 2 processes: rank 0: CheckpointError: "
        f"The previous asynchronous checkpoint save failed: Checkpoint {folder} is in place and loads"
    )
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "checkpoint_0",
        "checkpoint_1",
        "latest",
    ]
    assert len(results[0]) == len(results[1]) == 2
    assert "checkpoint_1 is in place and loads, but making it durable failed" in results[0][1]
    assert results[1][1].startswith("The previous asynchronous checkpoint save failed on 1 of 2 processes: ")


def test_kill_9_at_20_random_moments_after_the_call_leaves_the_new_checkpoint(tmp_path):
    """tests/scripts/kill_background_commit.py: 20 forked children killed at seeded moments over 1.5 times
    the length of the background fsync after ``save_state`` returned; the folder is final at return and a
    killed process loses nothing it handed to the operating system, so each time the new checkpoint is the
    newest valid one and holds its own weights."""
    script = SCRIPTS / "kill_background_commit.py"
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path), "20", "0"],
        capture_output=True,
        text=True,
        timeout=300,
        env=cli_env(OMP_NUM_THREADS="1"),
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    outcomes = [kill["outcome"] for kill in result["kills"]]
    assert outcomes == ["new"] * 20, outcomes
    delays = [kill["delay"] for kill in result["kills"]]
    assert min(delays) < result["commit_seconds"] < max(delays)  # moments inside and after the fsync


def test_saving_over_an_existing_folder_fsyncs_before_returning(tmp_path, monkeypatch):
    """The new files cannot be shown in place of a committed checkpoint before they are durable without
    risking both to a crash: such a save fsyncs every file on the training thread before it returns, even by
    default."""
    accelerator = Accelerator()  # no automatic naming: save_state(folder) writes folder itself
    model = torch.nn.Linear(8, 4)
    model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    folder = tmp_path / "explicit"
    accelerator.save_state(folder)
    accelerator.wait_for_checkpoint()
    with torch.no_grad():
        model.weight.add_(1.0)
    calls: list[tuple[str, str]] = []
    real = os.fsync

    def recorded(fd: int) -> None:
        calls.append((threading.current_thread().name, os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        real(fd)

    monkeypatch.setattr(os, "fsync", recorded)
    accelerator.save_state(folder)
    on_the_training_thread = {name for thread, name in calls if thread == threading.current_thread().name}
    assert {"model.safetensors", "optimizer.bin", "random_states_0.pkl"} <= on_the_training_thread
    assert layout.verify(folder).files.keys() >= {"model.safetensors"}
    assert torch.equal(load_model_files(folder)["weight"], model.weight.detach())


def test_no_file_is_fsynced_on_the_training_thread_and_every_file_is_in_the_background(tmp_path, monkeypatch):
    """The weights were fsynced on the training thread (save_model_files' own fsync) while the other files
    waited for the commit: on a 302 MB checkpoint the stall of a background-durable save was 0.36 s against
    0.34 s for a synchronous one; 0.22-0.28 s with the weights' fsync left to the commit too."""
    accelerator, _ = _training(tmp_path)
    calls: list[tuple[str, str]] = []
    real = os.fsync

    def recorded(fd: int) -> None:
        calls.append((threading.current_thread().name, os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        real(fd)

    monkeypatch.setattr(os, "fsync", recorded)
    folder = Path(accelerator.save_state(durable="background"))
    on_the_training_thread = [name for thread, name in calls if thread == threading.current_thread().name]
    accelerator.wait_for_checkpoint()
    assert on_the_training_thread == []  # (other threads: an earlier test's commit may still be running)
    fsynced = {name for thread, name in calls if thread != threading.main_thread().name}
    assert {path.name for path in folder.iterdir() if path.is_file()} <= fsynced
    assert "model.safetensors" in fsynced and folder.name in fsynced


def test_with_total_limit_1_the_new_checkpoint_is_durable_before_the_previous_goes(tmp_path, monkeypatch):
    """With one checkpoint kept, deleting the previous one before the new one is durable could leave none
    after a power loss: that save fsyncs the new checkpoint first, then rotates (on the training thread)."""
    accelerator, _ = _training(tmp_path, total_limit=1)
    accelerator.save_state()
    accelerator.wait_for_checkpoint()
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append("fsync " + os.readlink(f"/proc/self/fd/{fd}").removeprefix(f"{tmp_path}/checkpoints/"))
        real_fsync(fd)

    def replace(source, destination, **kwargs) -> None:
        events.append(f"rename {Path(source).name} -> {Path(destination).name}")
        real_replace(source, destination, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    accelerator.save_state()
    rotated = events.index("rename checkpoint_0 -> .checkpoint_0.deleting")
    durable = {event for event in events[:rotated] if event.startswith("fsync checkpoint_1/")}
    assert {"fsync checkpoint_1/model.safetensors", f"fsync checkpoint_1/{layout.MANIFEST_NAME}"} <= durable
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_1", "latest"]


def test_a_slow_deletion_of_the_rotated_checkpoint_finishes_on_the_thread(tmp_path, monkeypatch):
    """A file system where deleting takes a while (0.3 s a file here): the rotated-out checkpoint is renamed
    away at once and the save returns after spending its 0.2 s on the deletion; the thread deletes the rest."""
    accelerator, _ = _training(tmp_path, total_limit=2)
    for _ in range(2):
        accelerator.save_state()
    accelerator.wait_for_checkpoint()
    real = os.unlink

    def slow(path, *args, **kwargs) -> None:
        if ".checkpoint_0.deleting" in str(path):
            threading.Event().wait(0.3)
        real(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", slow)
    accelerator.save_state()
    root = tmp_path / "checkpoints"
    listing = sorted(p.name for p in root.iterdir())
    assert listing == [".checkpoint_0.deleting", "checkpoint_1", "checkpoint_2", "latest"], listing
    assert layout.newest_valid_checkpoint(root) == root / "checkpoint_2"
    accelerator.wait_for_checkpoint()
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint_1", "checkpoint_2", "latest"]
